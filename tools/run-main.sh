#!/usr/bin/env bash
# The main job on a fresh machine: install, build, make the tiny kimi_k3 model and generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh build
./build/src/kestrel make-model --arch kimi_k3 --preset tiny --out models/kimi-k3-tiny --seed 0
./build/src/kestrel generate models/kimi-k3-tiny --prompt-ids 256,259,72,101,108,108,111,33 --max-tokens 16 \
  --dump-logits models/kimi-k3-tiny-logits.npy
echo "[main] logits of every position written to models/kimi-k3-tiny-logits.npy"
