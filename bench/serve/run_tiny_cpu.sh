#!/usr/bin/env bash
# Serving benchmark of the tiny kimi_k3 model on the CPU: `kestrel serve` on a free loopback port, then
# `kestrel bench serve` with the random and agentic datasets and a concurrency sweep. Writes the JSON results to
# bench/serve/results/ and the frontier plot to bench/results/serve_tiny_cpu_frontier.png.
# Usage: bench/serve/run_tiny_cpu.sh [path/to/kestrel]   (default: build/src/kestrel; Python from .venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
KESTREL=${1:-build/src/kestrel}
PY=${PYTHON:-.venv/bin/python}
OUT=bench/serve/results
WORK=$(mktemp -d)
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT

"$KESTREL" make-model --arch kimi_k3 --preset tiny --out "$WORK/tiny" >/dev/null
# The benchmark client shares the cores: one OpenMP thread per engine step (tiny models gain nothing from more).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$KESTREL" serve "$WORK/tiny" --host 127.0.0.1 --port 0 \
  --served-model-name kimi-k3-tiny 2>"$WORK/server.log" &
SERVER=$!
for _ in $(seq 100); do grep -q "on http://" "$WORK/server.log" && break; sleep 0.1; done
PORT=$(sed -n 's/.*on http:\/\/127\.0\.0\.1:\([0-9]*\).*/\1/p' "$WORK/server.log")
URL=http://127.0.0.1:$PORT
echo "server on $URL"

"$KESTREL" bench serve --base-url "$URL" --dataset random --num-prompts 200 --max-concurrency 16 \
  --random-input-len 512 --random-output-len 64 --ignore-eos --goodput ttft:2000 tpot:100 \
  --save-result "$OUT/serve_tiny_cpu_random.json"
"$KESTREL" bench serve --base-url "$URL" --dataset agentic --num-prompts 80 --max-concurrency 8 \
  --agentic-turns 5 --agentic-prefix-len 2048 --agentic-turn-len 256 --random-output-len 32 \
  --agentic-think-time 0.2 --ignore-eos --save-result "$OUT/serve_tiny_cpu_agentic.json"
"$KESTREL" bench serve --base-url "$URL" --dataset random --num-prompts 64 --random-input-len 256 \
  --random-output-len 64 --ignore-eos --sweep-concurrency 1,2,4,8,16,32 \
  --save-result "$OUT/serve_tiny_cpu_sweep.json"
"$PY" bench/serve/plot_frontier.py "$OUT/serve_tiny_cpu_sweep.json" --out bench/results/serve_tiny_cpu_frontier.png \
  --title "kimi_k3 tiny on the CPU: random 256 in / 64 out"
kill -TERM "$SERVER"
wait "$SERVER"
