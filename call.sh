#!/usr/bin/env bash
# session 15, call 3 (final)
set -u
T0=$(date +%s); t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
S='^(decode|gates|prefill|[a-z_.]+ = )'
R=tensorfold.ops.triton_route
t suite
bash bench/gpu_suite.sh tests/test_gpu_kernels.py tests/test_gpu_gates.py -k "(norm_in_the_routers or moe_gated or own_tile or wide_experts or linear_rows or norms_and_rope or lfm2_moe or gemma4) and not tp_2 and not fp8_kv_agreement and not glm5_next" 2>&1 | grep -E "passed|failed|Error|FAIL" | tail -8
export PYTHONPATH=/tmp/site
t lf8; timeout $(left) python3 bench/lfm2_speed.py --sections decode,gates,prefill,profile --out $OUT/l8 2>&1 | grep -E "$S"
mkdir -p $OUT/k; for f in decode1 decode8 decode64; do head -14 $OUT/l8/kernels_$f.tsv | cut -c1-60 > $OUT/k/$f.tsv; done
python3 -c "import json;r=json.load(open('$OUT/l8/results.json'));print('prefill', {k:round(v.get('tokens_per_s',0)) for k,v in r.get('prefill',{}).items() if isinstance(v,dict)})"
t lf8 few-off; timeout $(left) python3 bench/with_switch.py $R.FUSE_FEW_ROWS=False bench/lfm2_speed.py --sections decode --out $OUT/l8b 2>&1 | grep -E "$S"
t lf8 align-off; timeout $(left) python3 bench/with_switch.py $R.FUSE_FEW_ROWS=False $R.ALIGN_FEW_ROWS=False bench/lfm2_speed.py --sections decode --out $OUT/l8c 2>&1 | grep -E "$S"
t g4; timeout $(left) python3 bench/gemma4_speed.py --sections decode,gates --out $OUT/g4 2>&1 | grep -E "$S"
t lf24; timeout $(left) python3 bench/lfm2_speed.py --shape LFM2-24B-A2B --sections decode --out $OUT/l24 2>&1 | grep -E "$S"
t serve; timeout $(left) bash bench/serve_dummy.sh 2>&1 | tail -4
t end
rm -rf $OUT/l8 $OUT/l8b $OUT/l8c $OUT/g4 $OUT/l24 $OUT/gpu.xml
find $OUT -type f -size +100k -delete
