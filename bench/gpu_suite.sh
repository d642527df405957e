#!/usr/bin/env bash
# The GPU suite on a CUDA machine without a package registry (the device machine): install the
# wheels its image lacks from .whl/ (docs/performance.md, "How to measure"), the project and
# its plugins, then `pytest -m gpu`. The log and a JUnit report go to $OUT (or ./gpu_out).
#   bash bench/gpu_suite.sh [pytest arguments]
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-gpu_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  -e . -e plugins/lfm2_moe -e plugins/glm -e plugins/gemma4 || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/nvidia_smi.txt" 2>&1

set -o pipefail
python3 -m pytest -m gpu -q --durations=15 --junitxml="$out/gpu.xml" "$@" \
  2>&1 | tee "$out/gpu_suite.log"
