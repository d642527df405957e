#!/usr/bin/env bash
# One call on the GPU machine, from the root of a tree made by bench/make_tree.sh: install the
# wheels the image lacks (not fla-core), tensorfold and the lfm2_moe plugin, then the benchmark.
#   bash bench/device_run.sh --commit abc1234 [lfm2_speed.py arguments]
set -u
export PYTHONUNBUFFERED=1
w=.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $w/annotated_types-*.whl $w/pydantic-*.whl $w/pydantic_core-*.whl \
  $w/pydantic_settings-*.whl $w/python_dotenv-*.whl $w/structlog-*.whl \
  $w/transformers-*.whl $w/typing_extensions-*.whl $w/typing_inspection-*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation . plugins/lfm2_moe || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
  --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 bench/lfm2_speed.py --out "$OUT" "$@"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
  --format=csv,noheader >> "$OUT/nvidia_smi.txt" 2>&1
