#!/usr/bin/env bash
# Builds the top-level project on the GPU machine -- the `kestrel` binary users run, every GPU test (CTest label gpu:
# tests/kernels/cuda, tests/gpu) and every GPU benchmark (bench/gpu) -- with the dependencies carried in .devdeps
# (bench/gpu/make_devdeps.sh; the machine has nvcc, cmake, ninja and g++ but no -dev packages and no network), then
# runs the GPU tests and the benchmarks asked for. The build folder (build-h200/, git-ignored) is kept between calls
# on a warm machine, so a later call rebuilds only what changed.
# Usage, from anywhere:
#   bench/gpu/run_h200.sh [--build-only] [--tests REGEX | --no-tests] [--bench NAME[,NAME...]] [log-dir]
#   --tests REGEX: only the test binaries whose names match; --no-tests: none. --bench: bench/gpu/NAME_bench binaries
#   (e.g. gemm_fp8_block,model_step), each with the arguments in KESTREL_BENCH_ARGS_<NAME> if set. log-dir defaults
#   to $OUT. Each test binary and benchmark is capped at KESTREL_GPU_TEST_S / KESTREL_GPU_BENCH_S seconds (300).
#   KESTREL_GPU_JOBS test binaries run at once (2: they share the GPU; their CPU references use the cores).
# Writes env.txt, build.log, test-T.log and test-T.xml per test binary, test.log (their summaries), bench-B.log.
# Exits 0 when everything it ran passed, 1 otherwise, 2 on a usage error.
set -uo pipefail
usage() {
  echo "usage: bench/gpu/run_h200.sh [--build-only] [--tests REGEX | --no-tests] [--bench NAME[,NAME...]] [log-dir]" >&2
  exit 2
}
BUILD_ONLY=0
TESTS_RE=.
BENCHES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) BUILD_ONLY=1 ;;
    --tests) [ $# -ge 2 ] || usage; TESTS_RE=$2; shift ;;
    --no-tests) TESTS_RE='^$' ;;
    --bench) [ $# -ge 2 ] || usage; BENCHES=$2; shift ;;
    -*) usage ;;
    *) break ;;
  esac
  shift
done
[ $# -le 1 ] || usage
cd "$(dirname "$0")/../.."
ROOT=$PWD
LOGS=${1:-${OUT:-$ROOT/out-gpu}}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
DEPS=$ROOT/.devdeps
BUILD=$ROOT/build-h200
TEST_S=${KESTREL_GPU_TEST_S:-300}
BENCH_S=${KESTREL_GPU_BENCH_S:-300}
JOBS=${KESTREL_GPU_JOBS:-2}
[ -d "$DEPS/include" ] || { echo "no .devdeps: run bench/gpu/make_devdeps.sh here and carry .devdeps"; exit 1; }
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
# make-model trains its tokenizer on the King James text; the machine has no bible-kjv package.
export KESTREL_KJV_TEXT=$DEPS/kjv.txt
export LD_LIBRARY_PATH=$DEPS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  date -u
  git -C "$ROOT" log -1 --format='commit %H' 2>/dev/null
  nvidia-smi
  nvcc --version
  cmake --version | head -1
  c++ --version | head -1
  nproc
  free -g
} >"$LOGS/env.txt" 2>&1

build() {
  set -e
  if [ ! -f "$DEPS/gtest/lib/cmake/GTest/GTestConfig.cmake" ]; then
    cmake -S "$DEPS/googletest" -B "$DEPS/gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=ON \
      -DCMAKE_INSTALL_PREFIX="$DEPS/gtest"
    cmake --build "$DEPS/gtest-build" -j"$(nproc)"
    cmake --install "$DEPS/gtest-build"
  fi
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$DEPS/cmake;$DEPS/gtest" -DCMAKE_INCLUDE_PATH="$DEPS/include" -DCMAKE_LIBRARY_PATH="$DEPS/lib" \
    -DCMAKE_CXX_FLAGS="-isystem $DEPS/include" -DBoost_INCLUDE_DIR="$DEPS/include" -DBoost_NO_BOOST_CMAKE=ON \
    -DKESTREL_PYTHON=OFF
  cmake --build "$BUILD" -j"$(nproc)"
}
t0=$(date +%s)
if ! (build) >"$LOGS/build.log" 2>&1; then
  grep -E "error|Error" "$LOGS/build.log" | head -40
  echo "build failed after $(($(date +%s) - t0)) s (full log: build.log)"
  exit 1
fi
echo "build ok in $(($(date +%s) - t0)) s"
[ "$BUILD_ONLY" = 1 ] && exit 0

failed=()
: >"$LOGS/test.log"
run_test() {
  local t=$1 bin
  bin=$(find "$BUILD/tests" -maxdepth 1 -type f -name "$t")
  timeout "$TEST_S" "$bin" --gtest_output=xml:"$LOGS/test-$t.xml" >"$LOGS/test-$t.log" 2>&1
  echo "$?" >"$LOGS/rc-$t"
}
mapfile -t TESTS < <(cd "$ROOT/tests" && ls kernels/cuda/*_test.cpp gpu/*_test.cpp | xargs -n1 basename | sed 's/\.cpp$//' |
  grep -E "$TESTS_RE")
t0=$(date +%s)
running=0
for t in "${TESTS[@]}"; do
  run_test "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait
for t in "${TESTS[@]}"; do
  rc=$(cat "$LOGS/rc-$t" 2>/dev/null || echo 99)
  rm -f "$LOGS/rc-$t"
  {
    echo "== $t exit $rc"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests? ran|Failure|error:|Expected|Which is" "$LOGS/test-$t.log" | head -40
  } >>"$LOGS/test.log"
  [ "$rc" = 0 ] || failed+=("$t")
done
[ ${#TESTS[@]} -gt 0 ] && echo "tests: ${#TESTS[@]} binaries in $(($(date +%s) - t0)) s, failed: ${failed[*]:-none}"

for b in ${BENCHES//,/ }; do
  var="KESTREL_BENCH_ARGS_${b}"
  echo "== ${b}_bench ${!var:-}"
  # shellcheck disable=SC2086
  timeout "$BENCH_S" "$BUILD/bench/${b}_bench" ${!var:-} 2>&1 | tee "$LOGS/bench-$b.log" | tail -60
  rc=${PIPESTATUS[0]}
  echo "${b}_bench exit $rc"
  [ "$rc" = 0 ] || failed+=("${b}_bench")
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all passed"
