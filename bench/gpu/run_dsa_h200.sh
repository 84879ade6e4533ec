#!/usr/bin/env bash
# Builds and runs the DSA kernels' GPU test (tests/kernels/cuda/dsa_kernels_test.cpp) and decode benchmark
# (bench/gpu/dsa_decode_bench.cpp) on the H200 device machine, which has nvcc and g++ but no -dev packages and no
# network: fmt (header-only) and googletest come from the git-ignored .devdeps/ folder (carry it; .devdeps/README
# says how it is made). Compiles exactly the sources these two programs need, with nvcc and g++ directly, so that
# nothing else in the tree has to build there.
# Usage, from anywhere: bench/gpu/run_dsa_h200.sh [log-dir]   (default: $OUT, else ./out-gpu)
#   --build-only as the first argument stops after linking (to check the build on a machine without a GPU).
#   KESTREL_DSA_PROFILE=1 adds an Nsight Compute profile of one launch of each stage (ncu.txt);
#   KESTREL_DSA_RACECHECK=1 adds a compute-sanitizer racecheck of small cases (racecheck.log);
#   KESTREL_DSA_MEMCHECK_S caps the memcheck of small cases (seconds, default 75; 0 skips it).
# Writes env.txt, build.log, sass.txt, test.log, test.xml, bench.log and memcheck.log to the log dir; exits
# non-zero if the build, a test or the benchmark failed.
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
BUILD=${KESTREL_DSA_BUILD:-/tmp/kestrel-dsa-build}
mkdir -p "$LOGS" "$BUILD"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")

{
  date -u
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
  cxx tests/kernels/cuda/dsa_kernels_test.cpp dsa_kernels_test
  cxx bench/gpu/dsa_decode_bench.cpp dsa_decode_bench
  cu src/kernels/cuda/dsa_index.cu dsa_index
  cu src/kernels/cuda/dsa_topk.cu dsa_topk
  cu src/kernels/cuda/dsa_mla.cu dsa_mla
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  [ "$failed" = 0 ]
  local lib=("$BUILD"/{formats,attention,basic,runtime,dsa_index,dsa_topk,dsa_mla}.o)
  local link=(-fopenmp -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lpthread)
  g++ "$BUILD/dsa_kernels_test.o" "${lib[@]}" "$BUILD/gtest-all.o" "$BUILD/gtest_main.o" "${link[@]}" \
    -o "$BUILD/dsa_kernels_test"
  g++ "$BUILD/dsa_decode_bench.o" "${lib[@]}" "${link[@]}" -o "$BUILD/dsa_decode_bench"
}
if ! (build) >"$LOGS/build.log" 2>&1; then
  grep -E "error|Error" "$LOGS/build.log" | head -40
  echo "build failed (full log: build.log)"
  exit 1
fi
grep -iE "warning|spill" "$LOGS/build.log" | head -20
echo "build ok"
[ "$BUILD_ONLY" = 1 ] && exit 0

# Registers, shared memory and the matrix instructions of each kernel, from the machine code that ran.
if command -v cuobjdump >/dev/null 2>&1 || [ -x "$CUDA_HOME/bin/cuobjdump" ]; then
  OBJDUMP=$(command -v cuobjdump || echo "$CUDA_HOME/bin/cuobjdump")
  for o in dsa_index dsa_topk dsa_mla; do
    echo "== $o"
    "$OBJDUMP" --dump-resource-usage "$BUILD/$o.o" 2>&1 | grep -E "Function|REG|SHARED" | sed 's/^ *//'
    "$OBJDUMP" --dump-sass "$BUILD/$o.o" 2>/dev/null |
      awk '/Function :/{f=$3} /(HMMA|IMMA|QMMA|HGMMA|LDGSTS|LDL|STL)/{match($0,/(HMMA|IMMA|QMMA|HGMMA|LDGSTS|LDL|STL)[.A-Z0-9]*/); n[f" "substr($0,RSTART,RLENGTH)]++} END{for(k in n) print n[k], k}' |
      sort -k2
  done >"$LOGS/sass.txt" 2>&1
fi

"$BUILD/dsa_kernels_test" --gtest_output=xml:"$LOGS/test.xml" >"$LOGS/test.log" 2>&1
test_rc=$?
grep -E "^\[  (FAILED|PASSED|SKIPPED) |largest|Failure|error:|Expected|Which is|first differing" "$LOGS/test.log" | head -60
"$BUILD/dsa_decode_bench" 2>&1 | tee "$LOGS/bench.log"
bench_rc=${PIPESTATUS[0]}
# Out-of-bounds and race checks on the smaller cases (informational: never fails the run).
SAN=$(command -v compute-sanitizer || ls "$CUDA_HOME"/bin/compute-sanitizer 2>/dev/null | head -1)
MEMCHECK_S=${KESTREL_DSA_MEMCHECK_S:-75}
if [ -n "$SAN" ] && [ "$MEMCHECK_S" != 0 ]; then
  timeout "$MEMCHECK_S" "$SAN" --tool memcheck --error-exitcode 3 "$BUILD/dsa_kernels_test" \
    --gtest_filter='DsaIndexKeyWriter.*:DsaTopk.Speculative*:*DsaIndexScores*/0:*DsaSparseMla*/4' >"$LOGS/memcheck.log" 2>&1
  echo "memcheck exit $? ($(grep -E 'ERROR SUMMARY' "$LOGS/memcheck.log" | tail -1))"
  if [ "${KESTREL_DSA_RACECHECK:-0}" = 1 ]; then
    timeout 45 "$SAN" --tool racecheck --error-exitcode 3 "$BUILD/dsa_kernels_test" \
      --gtest_filter='DsaTopk.Speculative*:*DsaIndexScores*/1:*DsaSparseMla*/4' >"$LOGS/racecheck.log" 2>&1
    echo "racecheck exit $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/racecheck.log" | tail -1))"
  fi
fi
NCU=$(command -v ncu || ls "$CUDA_HOME"/bin/ncu 2>/dev/null | head -1)
if [ "${KESTREL_DSA_PROFILE:-0}" = 1 ] && [ -n "$NCU" ]; then
  timeout 90 "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy -k regex:'index_scores|topk_kernel|sparse_mla' \
    "$BUILD/dsa_decode_bench" --profile >"$LOGS/ncu.txt" 2>&1
  echo "ncu exit $?"
fi
echo "dsa_kernels_test exit $test_rc, dsa_decode_bench exit $bench_rc"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
