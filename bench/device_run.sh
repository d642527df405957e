#!/usr/bin/env bash
# One call on the GPU machine, from the repository root with the wheels its image lacks in
# .whl/ (docs/performance.md, "How to measure"): install them (not
# fla-core: glm_speed.py needs it, so run that one after bench/gpu_suite.sh's install lines),
# tensorfold and the plugins a benchmark needs, then the benchmark; its files go to $OUT.
#   bash bench/device_run.sh --commit abc1234 [lfm2_speed.py arguments]     (LFM2-MoE)
#   bash bench/device_run.sh SCRIPT PLUGIN_DIR... -- [SCRIPT arguments]
#   e.g. bash bench/device_run.sh bench/gemma4_speed.py plugins/lfm2_moe plugins/gemma4 -- --commit abc1234
# (gemma4_speed.py reuses lfm2_speed.py's sections, so it needs both plugins.)
set -u
export PYTHONUNBUFFERED=1
script=bench/lfm2_speed.py
plugins=(plugins/lfm2_moe)
if [[ "${1:-}" == *.py ]]; then
  script=$1
  shift
  plugins=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do plugins+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
fi
w=.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $w/annotated_types-*.whl $w/pydantic-*.whl $w/pydantic_core-*.whl \
  $w/pydantic_settings-*.whl $w/python_dotenv-*.whl $w/structlog-*.whl \
  $w/transformers-*.whl $w/typing_extensions-*.whl $w/typing_inspection-*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation . "${plugins[@]}" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
  --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 "$script" --out "$OUT" "$@"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
  --format=csv,noheader >> "$OUT/nvidia_smi.txt" 2>&1
