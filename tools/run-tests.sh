#!/usr/bin/env bash
# The test command on a fresh machine: install, build, run every CPU test (ctest), then the Python golden tests.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh build
# Idle OpenMP threads sleep instead of spinning: several test binaries share the cores (ctest -j).
export OMP_WAIT_POLICY=passive
# The GPU tests (label gpu) are compiled here and run on a GPU machine (bench/gpu/run_h200.sh).
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600 -LE gpu

# The libFuzzer harnesses (tests/fuzz: a fixed number of inputs each, from a fixed seed), where Debian's clang is.
if command -v clang++ >/dev/null; then
  cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
  ninja -C build-fuzz
  ctest --test-dir build-fuzz --output-on-failure --timeout 900
fi

python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
.venv/bin/pip install -q --disable-pip-version-check --no-deps -r tests/python/requirements-grammar.txt
KESTREL_BIN="$PWD/build/src/kestrel" KESTREL_REQUIRE_XGRAMMAR=1 .venv/bin/python -m pytest -q tests/python
