#!/usr/bin/env bash
# session 15, call 4: the final commit, confirmation
set -u
T0=$(date +%s); t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
S='^(decode|gates)'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/lfm2_moe -e plugins/gemma4
t lf8; python3 bench/lfm2_speed.py --sections decode,gates --out $OUT/l8 2>&1 | grep -E "$S"
t g4; python3 bench/gemma4_speed.py --sections decode --out $OUT/g4 2>&1 | grep -E "$S"
t end
rm -rf $OUT/l8 $OUT/g4
