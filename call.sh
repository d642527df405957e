#!/usr/bin/env bash
# session 15, call 2
set -u
T0=$(date +%s); t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
S='^(decode|gates|[a-z_.]+ = )'
t suite
bash bench/gpu_suite.sh tests/test_gpu_kernels.py -k "wide_experts or moe_gated or own_tile" 2>&1 | tail -3
export PYTHONPATH=/tmp/site
t sweep swiglu; python3 bench/decode_kernels.py --moe-tiles --moe-kernel swiglu --moe-grid "32,64;2,4;5,8;64,128" --out $OUT/ms 2>&1 | tail -4
t lf; python3 bench/lfm2_speed.py --sections decode,gates,profile --out $OUT/l0 2>&1 | grep -E "$S"
mkdir -p $OUT/k; cp $OUT/l0/kernels_decode1.tsv $OUT/l0/kernels_decode8.tsv $OUT/k/ 2>/dev/null; rm -rf $OUT/l0 $OUT/l1
t lf ids-from-memory; python3 bench/with_switch.py tensorfold.ops.triton_route.IDS_KEPT=False bench/lfm2_speed.py --sections decode --out $OUT/l1 2>&1 | grep -E "$S"
t g4; python3 bench/gemma4_speed.py --sections decode,gates --out $OUT/g0 2>&1 | grep -E "$S"
t g4 ids-from-memory; python3 bench/with_switch.py tensorfold.ops.triton_route.IDS_KEPT=False bench/gemma4_speed.py --sections decode --out $OUT/g1 2>&1 | grep -E "$S"
t lm_head sweep; timeout $(( 570 - ($(date +%s) - T0) )) python3 bench/decode_kernels.py --tiles --shapes "lfm2 lm_head" --grid "64,128;64,128,256;3,4,6;1;4,8" --out $OUT/lm 2>&1 | tail -3
python3 - <<'PY'
import json, os
p = os.environ["OUT"] + "/lm/tile_sweep.json"
if os.path.exists(p):
    r = json.load(open(p))
    for shape, rows in r.items():
        best = sorted(((v["us"], k, v["m8_us"], v["m64_us"], v["equal"]) for k, v in rows.items() if "us" in v))[:8]
        print(shape, "shipped", rows.get("shipped"))
        for b in best: print("  ", b)
PY
t end
find $OUT -type f -size +300k -delete; rm -rf $OUT/g0 $OUT/g1 $OUT/lm/*.json $OUT/ms/*.json
