#!/usr/bin/env bash
# The main job on a fresh machine: install and build, make the tiny kimi_k3 model, serve it on the CPU with the
# seed's parsers, send it a real chat request (streamed and not), then stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh build
MODEL=models/kimi-k3-tiny
PORT=${PORT:-8000}
./build/src/kestrel make-model --arch kimi_k3 --preset tiny --out "$MODEL" --seed 0

# One OpenMP thread: the tiny model is far too small to share out, and the client runs on the same cores.
OMP_NUM_THREADS=1 ./build/src/kestrel serve "$MODEL" --served-model-name kimi-k3-tiny --host 127.0.0.1 --port "$PORT" \
  --enable-auto-tool-choice --tool-call-parser kimi_k3 --reasoning-parser kimi_k3 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "[main] the server exited"; exit 1; }
  sleep 0.2
done

REQUEST='{"model": "kimi-k3-tiny", "messages": [{"role": "system", "content": "You are Kestrel."},
  {"role": "user", "content": "In the beginning God created"}], "max_tokens": 24, "temperature": 0.8, "seed": 1}'
echo "[main] POST /v1/chat/completions"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$REQUEST"
echo
echo "[main] the same request, streamed"
curl -sS -N "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "${REQUEST%\}}, \"stream\": true, \"stream_options\": {\"include_usage\": true}}"
echo "[main] done (weights are random: the text is not meant to make sense)"
