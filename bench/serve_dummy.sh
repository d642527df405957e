#!/usr/bin/env bash
# The server bench, one call on the GPU machine: `tensorfold serve` at an LFM2 shape with dummy
# weights, measured from outside by `tensorfold bench openai` (and the concurrency gate through
# the server). Run from the repository root with the wheels the machine's image lacks in
# .whl/ (docs/performance.md, "How to measure"); writes under $OUT.
#   bash bench/serve_dummy.sh [SHAPE]    (LFM2-8B-A1B or LFM2-24B-A2B; default the 8B)
#   SMOKE=1 PORT=8123 OUT=/tmp/x bash bench/serve_dummy.sh demo
#       (the CPU check: the demo's shape, a few tokens, nothing installed)
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-serve_out}
mkdir -p "$out"
port=${PORT:-8000}
if [ "${SMOKE:-0}" = 1 ]; then
  tokens=16 repeats=1 levels=1,2 gate_tokens=8 folder=$out/model
else
  tokens=256 repeats=3 levels=1,2,4,8 gate_tokens=32 folder=/tmp/lfm2-8b-dummy
  w=.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $w/annotated_types-*.whl $w/pydantic-*.whl $w/pydantic_core-*.whl \
    $w/pydantic_settings-*.whl $w/python_dotenv-*.whl $w/structlog-*.whl \
    $w/typing_extensions-*.whl $w/typing_inspection-*.whl || exit 1
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . plugins/lfm2_moe || exit 1
fi
python3 bench/dummy_folder.py "$folder" "${1:-LFM2-8B-A1B}" || exit 1
python3 -m tensorfold.cli serve --family lfm2_moe --model "$folder" --load-format dummy \
  --parallel 8 --context 4096 --port "$port" > "$out/serve_stdout.txt" 2> "$out/serve_log.txt" &
pid=$!
for _ in $(seq 300); do
  kill -0 $pid 2> /dev/null || break  # serve exited: the benches below report the failure
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" 2> /dev/null \
    && break
  sleep 1
done
url=http://127.0.0.1:$port/v1
python3 -m tensorfold.cli bench openai --url "$url" --max-tokens $tokens --repeats $repeats --json \
  | tee "$out/bench_openai.txt"
python3 -m tensorfold.cli bench concurrent --url "$url" --levels $levels --alone \
  --max-tokens $gate_tokens | tail -3 | tee "$out/bench_concurrent.txt"
kill -INT $pid; wait $pid; echo "serve exit $?" >> "$out/serve_stdout.txt"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> "$out/serve_stdout.txt"
fi
