#!/usr/bin/env bash
# Installs what Kestrel builds and tests with on a fresh Debian 12 machine (root or sudo), then builds it.
# Usage: tools/setup.sh [build-dir]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

PKGS=(build-essential cmake pkg-config git python3 python3-venv
      nlohmann-json3-dev libfmt-dev libspdlog-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
      libboost-dev libonig-dev libxxhash-dev libopenblas-dev bible-kjv bible-kjv-text python3-dev pybind11-dev)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The CUDA backend is compiled whenever nvcc is found (on PATH or in /usr/local/cuda).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
