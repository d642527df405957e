#!/usr/bin/env bash
# Issue 17 on two GPUs in one call of under 9 minutes (nvidia-h200-x2), from the repository root
# with the wheels the machine's image lacks in .whl/ (docs/performance.md, "How to measure"):
#   1. tests/test_gpu_tp_reduce.py: symmetric sum == NCCL path bit for bit (eager, in a replayed
#      graph, back to back), engine tokens equal with either reduce, SIGINT stop of serve --tp 2;
#   2. bench/experiments/tp_reduce.py: per-call microseconds, NCCL path vs symmetric, eager and
#      in a graph;
#   3. bench/experiments/tp_speed.py: decode tokens/s at 1 and 64 streams, --tp 2 vs --tp 1, at
#      LFM2-8B-A1B, Gemma-4-26B-A4B and LFM2-24B-A2B shapes (dummy weights), and LFM2-8B at --tp 2 via nccl;
#   4. tests/test_gpu_gates.py -k tp_2: the engine gates at --tp 2 on the three demos, in what is
#      left (glm's first kernel pass alone took 90 s before: the gates may need a call of their
#      own, `bash bench/gpu_suite.sh tests/test_gpu_gates.py -k tp_2`).
# Each step gets at most what is left of the budget; logs and tables go to $OUT; summary last.
#   bash bench/experiments/tp2_run.sh
set -u
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the shared machines (KINDS.md), also in the ranks we start
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-tp2_out}
mkdir -p "$out"
budget=${TP2_BUDGET_S:-530}
t_start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t_start) )); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  -e . -e plugins/lfm2_moe -e plugins/glm -e plugins/gemma4 || exit 1
{ python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  "gpus", torch.cuda.device_count())'; nvidia-smi topo -m; } > "$out/env.txt" 2>&1

: > "$out/steps.txt"
step() {  # NAME SHARE_OF_WHAT_IS_LEFT_IN_SECONDS COMMAND...: the log in $OUT/NAME.log
  local name=$1 want=$2 t0 rc limit
  shift 2
  limit=$(left)
  [ "$want" -lt "$limit" ] && limit=$want
  if [ "$limit" -lt 20 ]; then echo "$name: skipped (budget spent)" >> "$out/steps.txt"; return; fi
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s)" >> "$out/steps.txt"
}

step reduce_tests 170 python3 -m pytest -m gpu -v -s --durations=10 tests/test_gpu_tp_reduce.py
step reduce_bench 40 python3 bench/experiments/tp_reduce.py --out "$out"
step tp_speed 190 python3 bench/experiments/tp_speed.py --out "$out" --budget-s 175
step tp2_gates 400 python3 -m pytest -m gpu -v --durations=10 tests/test_gpu_gates.py -k tp_2

{
  echo "== steps (budget ${budget} s, $(( $(date +%s) - t_start )) s used)"
  cat "$out/steps.txt"
  echo "== tests"
  grep -hE " (PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)|sigint stop:" \
    "$out/reduce_tests.log" "$out/tp2_gates.log" 2>/dev/null
  echo "== per-call sum (bench/experiments/tp_reduce.py)"
  cat "$out/tp_reduce.txt" 2>/dev/null || tail -5 "$out/reduce_bench.log"
  echo "== decode speed (bench/experiments/tp_speed.py)"
  cat "$out/tp_speed.txt" 2>/dev/null || tail -5 "$out/tp_speed.log"
} | tee "$out/summary.txt"
