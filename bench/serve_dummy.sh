#!/usr/bin/env bash
# One call on the GPU machine: `tensorfold serve` at an LFM2 shape with dummy weights,
# measured from outside by `tensorfold bench openai` (and the concurrency gate through the
# server). Run from a tree made by bench/make_tree.sh; writes under $OUT.
#   bash bench/serve_dummy.sh [SHAPE]    (LFM2-8B-A1B or LFM2-24B-A2B; default the 8B)
set -u
export PYTHONUNBUFFERED=1
w=.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $w/annotated_types-*.whl $w/pydantic-*.whl $w/pydantic_core-*.whl \
  $w/pydantic_settings-*.whl $w/python_dotenv-*.whl $w/structlog-*.whl \
  $w/typing_extensions-*.whl $w/typing_inspection-*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation . plugins/lfm2_moe || exit 1
python3 bench/dummy_folder.py /tmp/lfm2-8b-dummy "${1:-LFM2-8B-A1B}" || exit 1
python3 -m tensorfold.cli serve --family lfm2_moe --model /tmp/lfm2-8b-dummy --load-format dummy \
  --parallel 8 --context 4096 --port 8000 > "$OUT/serve_stdout.txt" 2> "$OUT/serve_log.txt" &
pid=$!
for _ in $(seq 300); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health')" 2>/dev/null && break; sleep 1; done
url=http://127.0.0.1:8000/v1
python3 -m tensorfold.cli bench openai --url $url --max-tokens 256 --repeats 3 --json | tee "$OUT/bench_openai.txt"
python3 -m tensorfold.cli bench concurrent --url $url --levels 1,2,4,8 --alone --max-tokens 32 \
  | tail -3 | tee "$OUT/bench_concurrent.txt"
kill -INT $pid; wait $pid; echo "serve exit $?" >> "$OUT/serve_stdout.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> "$OUT/serve_stdout.txt"
