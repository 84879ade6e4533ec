#!/usr/bin/env bash
# Builds and runs the CUDA KDA GPU tests and benchmark on a GPU machine that has nvcc, cmake, ninja and g++ but
# neither the Debian -dev packages nor a network (the H200 device machine). fmt (header-only) and the googletest
# sources in .devdeps/ (git-ignored; made by bench/gpu/make_devdeps.sh) replace the packages; carry that folder.
# It configures the small project in this folder (CMakeLists.txt), not the top-level one, so that only the
# dependencies of the CPU reference and the CUDA backend are needed.
# Usage, from anywhere: bench/gpu/run_h200.sh [log-dir]   (default: $OUT, else ./out-gpu)
# Writes env.txt, build.log, test.log, test.xml, bench.log and ncu.log to the log dir; exits non-zero if the
# build, a test or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
LOGS=${1:-${OUT:-$ROOT/out-gpu}}
DEPS=$ROOT/.devdeps
BUILD=${KESTREL_GPU_BUILD:-/tmp/kestrel-gpu-build}
mkdir -p "$LOGS"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi

{
  date -u
  nvidia-smi
  nvcc --version
  cmake --version | head -1
  c++ --version | head -1
} >"$LOGS/env.txt" 2>&1

build() {
  set -e
  cmake -S "$DEPS/googletest" -B "$BUILD/gtest" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DINSTALL_GTEST=ON -DCMAKE_INSTALL_PREFIX="$BUILD/gtest-install"
  cmake --build "$BUILD/gtest" -j"$(nproc)"
  cmake --install "$BUILD/gtest"
  cmake -S "$ROOT/bench/gpu" -B "$BUILD/kestrel" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$DEPS;$BUILD/gtest-install"
  cmake --build "$BUILD/kestrel" -j"$(nproc)" --target kda_cuda_test kda_cuda_bench
}
if ! (build) >"$LOGS/build.log" 2>&1; then
  tail -40 "$LOGS/build.log"
  echo "build failed (full log: build.log)"
  exit 1
fi

BIN=$BUILD/kestrel
"$BIN/kda_cuda_test" --gtest_output=xml:"$LOGS/test.xml" 2>&1 | tee "$LOGS/test.log"
test_rc=${PIPESTATUS[0]}
"$BIN/kda_cuda_bench" 2>&1 | tee "$LOGS/bench.log"
bench_rc=${PIPESTATUS[0]}
# Per-kernel times and DRAM bytes from Nsight Compute, when it is there (informational: never fails the run).
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$BIN/kda_cuda_bench" --profile >"$LOGS/ncu.log" 2>&1
  echo "ncu exit $? (ncu.log)"
  grep -E "kda_[a-z_]+kernel|gpu__time|dram__bytes" "$LOGS/ncu.log" | sed 's/  */ /g' | tail -30
fi
grep -E "largest relative error|relative error o|PASSED|FAILED" "$LOGS/test.log"
cat "$LOGS/bench.log"
echo "kda_cuda_test exit $test_rc, kda_cuda_bench exit $bench_rc"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
