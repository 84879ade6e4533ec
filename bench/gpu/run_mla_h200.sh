#!/usr/bin/env bash
# Builds and runs the dense MLA decode kernel's GPU test (tests/kernels/cuda/mla_decode_test.cpp) and benchmark
# (bench/gpu/mla_decode_bench.cpp, which also times the DSA kernels of dsa.h at the same shapes) on the H200 device
# machine, which has nvcc and g++ but no -dev packages and no network: fmt (header-only) and googletest come from
# the git-ignored .devdeps/ folder (carry it; bench/gpu/make_devdeps.sh makes it). Compiles exactly the sources
# these two programs need, with nvcc and g++ directly.
# Usage, from anywhere: bench/gpu/run_mla_h200.sh [log-dir]   (default: $OUT, else ./out-gpu)
#   --build-only as the first argument stops after linking (to check the build on a machine without a GPU).
#   KESTREL_MLA_PROFILE=1 adds an Nsight Compute profile of the dense kernel (ncu.txt);
#   KESTREL_MLA_SANITIZE_S caps each compute-sanitizer run (memcheck, racecheck) of small cases (seconds, default
#   40; 0 skips them). The test and the benchmark are capped at 100 and 120 s, the profile at 50 s.
# Writes env.txt, build.log, sass.txt, test.log, bench.log, memcheck.log, racecheck.log (and ncu.txt) to the log
# dir; exits non-zero if the build, a test or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD_ONLY=0
if [ "${1:-}" = "--build-only" ]; then
  BUILD_ONLY=1
  shift
fi
LOGS=${1:-${OUT:-$ROOT/out-gpu}}
DEPS=$ROOT/.devdeps
GT=$DEPS/googletest/googletest
BUILD=${KESTREL_MLA_BUILD:-/tmp/kestrel-mla-build}
mkdir -p "$LOGS" "$BUILD"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")

{
  date -u
  git -C "$ROOT" log -1 --format='commit %H' 2>/dev/null
  nvidia-smi 2>&1
  nvcc --version
  g++ --version | head -1
} >"$LOGS/env.txt" 2>&1

CXXFLAGS=(-std=c++20 -O2 -Wall -Wextra -ffp-contract=off -fno-fast-math -fopenmp -I"$ROOT/src" -I"$DEPS/include"
  -DFMT_HEADER_ONLY=1 -I"$CUDA_HOME/include" -I"$GT/include" -I"$GT")
NVFLAGS=(-std=c++20 -O3 -I"$ROOT/src" -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90
  -Xptxas=-warn-spills --expt-relaxed-constexpr)

build() {
  set -e
  local pids=()
  cxx() { g++ "${CXXFLAGS[@]}" -c "$1" -o "$BUILD/$2.o" & pids+=($!); }
  cu() { nvcc "${NVFLAGS[@]}" -c "$1" -o "$BUILD/$2.o" & pids+=($!); }
  cxx "$GT/src/gtest-all.cc" gtest-all
  cxx "$GT/src/gtest_main.cc" gtest_main
  cxx src/core/formats.cpp formats
  cxx src/kernels/cpu/attention.cpp attention
  cxx src/kernels/cpu/basic.cpp basic
  cxx src/kernels/cuda/runtime.cpp runtime
  cxx tests/kernels/cuda/mla_decode_test.cpp mla_decode_test
  cxx bench/gpu/mla_decode_bench.cpp mla_decode_bench
  cu src/kernels/cuda/mla_decode.cu mla_decode
  cu src/kernels/cuda/dsa_index.cu dsa_index
  cu src/kernels/cuda/dsa_topk.cu dsa_topk
  cu src/kernels/cuda/dsa_mla.cu dsa_mla
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  [ "$failed" = 0 ]
  local ref=("$BUILD"/{formats,attention,basic,runtime}.o)
  local link=(-fopenmp -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lpthread)
  g++ "$BUILD/mla_decode_test.o" "$BUILD/mla_decode.o" "${ref[@]}" "$BUILD/gtest-all.o" "$BUILD/gtest_main.o" \
    "${link[@]}" -o "$BUILD/mla_decode_test"
  g++ "$BUILD/mla_decode_bench.o" "$BUILD"/{mla_decode,dsa_index,dsa_topk,dsa_mla}.o "${ref[@]}" "${link[@]}" \
    -o "$BUILD/mla_decode_bench"
}
if ! (build) >"$LOGS/build.log" 2>&1; then
  grep -E "error|Error" "$LOGS/build.log" | head -40
  echo "build failed (full log: build.log)"
  exit 1
fi
grep -iE "warning|spill|serializ" "$LOGS/build.log" | head -20
echo "build ok"
[ "$BUILD_ONLY" = 1 ] && exit 0

# Registers, shared memory and the matrix instructions of the kernels, from the machine code that ran.
OBJDUMP=$(command -v cuobjdump || echo "$CUDA_HOME/bin/cuobjdump")
if [ -x "$OBJDUMP" ]; then
  "$OBJDUMP" --dump-resource-usage "$BUILD/mla_decode.o" 2>&1 | grep -E "Function|REG|SHARED" | sed 's/^ *//'
  "$OBJDUMP" --dump-sass "$BUILD/mla_decode.o" 2>/dev/null |
    awk '/Function :/{f=$3} /(HGMMA|HMMA|LDGSTS|LDL|STL|WARPSYNC|BAR)/{match($0,/(HGMMA|HMMA|LDGSTS|LDL|STL|WARPSYNC|BAR)[.A-Z0-9x]*/); n[f" "substr($0,RSTART,RLENGTH)]++} END{for(k in n) print n[k], k}' |
    sort -k2
fi >"$LOGS/sass.txt" 2>&1

timeout 100 "$BUILD/mla_decode_test" >"$LOGS/test.log" 2>&1
test_rc=$?
grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[       OK|largest|Failure|error:|Expected|Which is|differs" "$LOGS/test.log" | head -60
timeout 120 "$BUILD/mla_decode_bench" 2>&1 | tee "$LOGS/bench.log"
bench_rc=${PIPESTATUS[0]}
# Out-of-bounds and race checks on small cases (informational: never fails the run).
SAN=$(command -v compute-sanitizer || ls "$CUDA_HOME"/bin/compute-sanitizer 2>/dev/null | head -1)
SAN_S=${KESTREL_MLA_SANITIZE_S:-40}
if [ -n "$SAN" ] && [ "$SAN_S" != 0 ]; then
  timeout "$SAN_S" "$SAN" --tool memcheck --error-exitcode 3 "$BUILD/mla_decode_test" \
    --gtest_filter='*fp8_h16_*:*bf16_h64_*:MlaDecodeArguments.*' >"$LOGS/memcheck.log" 2>&1
  echo "memcheck exit $? ($(grep -E 'ERROR SUMMARY' "$LOGS/memcheck.log" | tail -1))"
  timeout "$SAN_S" "$SAN" --tool racecheck --error-exitcode 3 "$BUILD/mla_decode_test" \
    --gtest_filter='*fp8_h96_*:MlaDecodeArguments.*' >"$LOGS/racecheck.log" 2>&1
  echo "racecheck exit $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/racecheck.log" | tail -1))"
fi
NCU=$(command -v ncu || ls "$CUDA_HOME"/bin/ncu 2>/dev/null | head -1)
if [ "${KESTREL_MLA_PROFILE:-0}" = 1 ] && [ -n "$NCU" ]; then
  timeout 50 "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats -k regex:'mla_decode_kernel' \
    "$BUILD/mla_decode_bench" --profile >"$LOGS/ncu.txt" 2>&1
  echo "ncu exit $?"
fi
echo "mla_decode_test exit $test_rc, mla_decode_bench exit $bench_rc"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
