#!/usr/bin/env bash
# Builds the CUDA backend with every GPU test and GPU benchmark on a GPU machine that has nvcc, cmake, ninja and g++
# but neither the Debian -dev packages nor a network (the H200 device machine), runs every GPU test and, unless
# --tests-only, the chosen benchmarks. fmt (header-only) and the googletest sources in .devdeps/ (git-ignored; made
# by bench/gpu/make_devdeps.sh) replace the packages; carry that folder. It configures the small project in this
# folder (CMakeLists.txt), not the top-level one, so that only the CUDA backend's and the CPU reference's
# dependencies are needed. The tests and benchmarks it runs are the ones that project found
# (tests/kernels/cuda/*_test.cpp, bench/gpu/*_bench.cpp).
# Usage, from anywhere: bench/gpu/run_h200.sh [--tests-only | --bench kda|dsa|mla|model|all] [--build-only] [log-dir]
#   log-dir defaults to $OUT, else ./out-gpu. --bench NAME runs the benchmarks bench/gpu/NAME_*_bench.cpp (all:
#   every benchmark; the default) after the tests; --tests-only runs no benchmark; --build-only stops after
#   linking (to check the build on a machine without a GPU). Every test binary and every benchmark is capped at
#   KESTREL_GPU_TEST_S / KESTREL_GPU_BENCH_S seconds (default 300 each). A device call allows 10 minutes: with
#   the KDA profile and the sanitizers, `--bench all` can take longer than that; run one kind per call.
#   With the KDA benchmark: KESTREL_KDA_PROFILE=0 skips its Nsight Compute run (default on when ncu is there; 240 s
#   cap; ncu-kda.log). Right after kda_cuda_bench, in the same run, bench/gpu/peers_kda.py times the peer,
#   flash-linear-attention's chunk_kda and fused_recurrent_kda (python3 with torch and triton; the fla source in
#   .peers/fla-src, made by bench/gpu/make_peers.sh: carry `.peers` as well as `.devdeps`; capped at
#   KESTREL_GPU_BENCH_S; bench-peers_kda.log; without .peers it prints "fla not available"); KESTREL_KDA_PEERS=0
#   skips it.
#   With the DSA benchmark: KESTREL_DSA_PROFILE=1 adds an Nsight Compute profile of one launch of each stage
#   (ncu-dsa.txt); KESTREL_DSA_MEMCHECK_S caps the compute-sanitizer memcheck of small DSA cases (seconds, default
#   75; 0 skips it; memcheck-dsa.log); KESTREL_DSA_RACECHECK=1 adds a racecheck of small cases (racecheck-dsa.log).
#   Right after dsa_decode_bench, bench/gpu/peers_dsa.py times the DSA peers -- PyTorch eager DSA and dense MLA
#   decode layers, FlashMLA's sparse decode and prefill, DeepGEMM's paged and prefill FP8 indexer logits (the peers
#   of dsa_decode_bench and dsa_prefill_bench) -- one process per section
#   (KESTREL_DSA_PEERS_SECTIONS; each capped at KESTREL_GPU_BENCH_S; bench-peers_dsa.log; a section that segfaults
#   is re-run under gdb when there is one, gdb-peers_dsa-<section>.log, else under bench/gpu/native_backtrace.sh,
#   segv-peers_dsa-<section>.log: frames of DeepGEMM's and FlashMLA's modules resolved by addr2line). The libraries are
#   built from .peers/ into build-peers/ by bench/gpu/build_peers_h200.sh, which runs first
#   when KESTREL_DSA_PEERS_BUILD=1 (minutes; build-*.log); unbuilt peers print "not available";
#   KESTREL_DSA_PEERS=0 skips it.
#   With the MLA benchmark: KESTREL_MLA_PROFILE=1 adds an Nsight Compute profile of the dense kernel (ncu-mla.txt);
#   KESTREL_MLA_SANITIZE_S caps each of its memcheck and racecheck runs of small cases (seconds, default 40; 0
#   skips them; memcheck-mla.log, racecheck-mla.log).
#   KESTREL_GPU_BUILD names the build folder (default /tmp/kestrel-gpu-build).
# Writes env.txt, build.log, sass.txt (registers, shared memory and matrix/spill instructions per kernel), for
# each test binary T test-T.log and test-T.xml, test.log (their summary lines), for each benchmark B bench-B.log,
# and the peer, profile and sanitizer logs above to the log dir. The peer, the profiles and the sanitizers are
# informational and never fail the run. Exits 0 when everything it ran passed, 1 if the build, a test or a
# benchmark failed, 2 on a usage error.
set -uo pipefail
usage() {
  echo "usage: bench/gpu/run_h200.sh [--tests-only | --bench kda|dsa|mla|model|all] [--build-only] [log-dir]" >&2
  exit 2
}
BENCH=all
BUILD_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) BENCH=none ;;
    --build-only) BUILD_ONLY=1 ;;
    --bench)
      [ $# -ge 2 ] || usage
      BENCH=$2
      shift
      ;;
    -*) usage ;;
    *) break ;;
  esac
  shift
done
case "$BENCH" in none | kda | dsa | mla | model | all) ;; *) usage ;; esac
[ $# -le 1 ] || usage

cd "$(dirname "$0")/../.."
ROOT=$PWD
LOGS=${1:-${OUT:-$ROOT/out-gpu}}
DEPS=$ROOT/.devdeps
BUILD=${KESTREL_GPU_BUILD:-/tmp/kestrel-gpu-build}
BIN=$BUILD/kestrel
TEST_S=${KESTREL_GPU_TEST_S:-300}
BENCH_S=${KESTREL_GPU_BENCH_S:-300}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi

{
  date -u
  git -C "$ROOT" log -1 --format='commit %H' 2>/dev/null
  nvidia-smi
  nvcc --version
  cmake --version | head -1
  c++ --version | head -1
} >"$LOGS/env.txt" 2>&1

build() {
  set -e
  cmake -S "$ROOT/bench/gpu" -B "$BIN" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$DEPS" \
    -DKESTREL_GTEST_SOURCE_DIR="$DEPS/googletest"
  cmake --build "$BIN" -j"$(nproc)"
}
if ! (build) >"$LOGS/build.log" 2>&1; then
  grep -E "error|Error" "$LOGS/build.log" | head -40
  echo "build failed (full log: build.log)"
  exit 1
fi
grep -iE "warning|spill|serializ" "$LOGS/build.log" | grep -v googletest | head -20
read -r -a TESTS < <(tr ';' ' ' <"$BIN/gpu_tests.txt")
read -r -a ALL_BENCHES < <(tr ';' ' ' <"$BIN/gpu_benches.txt")
echo "build ok: ${TESTS[*]} ${ALL_BENCHES[*]}"

# Registers, shared memory and the matrix, async-copy, local-memory and barrier instructions of each kernel.
OBJDUMP=$(command -v cuobjdump || echo "$CUDA_HOME/bin/cuobjdump")
if [ -x "$OBJDUMP" ]; then
  find "$BIN/CMakeFiles/kestrel_kernels_cuda.dir" -name '*.cu.o' | sort | while read -r o; do
    echo "== $(basename "$o" .cu.o)"
    "$OBJDUMP" --dump-resource-usage "$o" 2>&1 | grep -E "Function|REG|SHARED" | sed 's/^ *//'
    "$OBJDUMP" --dump-sass "$o" 2>/dev/null |
      awk '/Function :/{f=$3} /(HMMA|IMMA|QMMA|HGMMA|LDGSTS|LDL|STL|WARPSYNC|BAR)/{match($0,/(HMMA|IMMA|QMMA|HGMMA|LDGSTS|LDL|STL|WARPSYNC|BAR)[.A-Z0-9x]*/); n[f" "substr($0,RSTART,RLENGTH)]++} END{for(k in n) print n[k], k}' |
      sort -k2
  done >"$LOGS/sass.txt" 2>&1
fi
[ "$BUILD_ONLY" = 1 ] && exit 0

failed=()
: >"$LOGS/test.log"
# make_model (tests/gpu, the model benchmark) trains its tokenizer on the King James text; the machine has no
# bible-kjv package, so make_devdeps.sh carries the text.
[ -f "$DEPS/kjv.txt" ] && export KESTREL_KJV_TEXT="$DEPS/kjv.txt"
for t in "${TESTS[@]}"; do
  # KESTREL_GPU_TEST_FILTER: a regular expression; only the test binaries whose names match run.
  if [ -n "${KESTREL_GPU_TEST_FILTER:-}" ] && ! [[ "$t" =~ $KESTREL_GPU_TEST_FILTER ]]; then continue; fi
  timeout "$TEST_S" "$BIN/$t" --gtest_output=xml:"$LOGS/test-$t.xml" >"$LOGS/test-$t.log" 2>&1
  rc=$?
  {
    echo "== $t exit $rc"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |largest|relative error o|Failure|error:|Expected|Which is|differs|first differing" \
      "$LOGS/test-$t.log" | head -60
  } | tee -a "$LOGS/test.log"
  [ "$rc" = 0 ] || failed+=("$t")
done

BENCHES=()
for b in "${ALL_BENCHES[@]}"; do
  if [ "$BENCH" = all ] || [[ "$b" == "$BENCH"_* ]]; then BENCHES+=("$b"); fi
done
kda_peers() {
  [ "${KESTREL_KDA_PEERS:-1}" = 1 ] || return 0
  echo "== peers_kda"
  PYTHONPATH="$ROOT/.peers/fla-src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout "$BENCH_S" \
    python3 "$ROOT/bench/gpu/peers_kda.py" 2>&1 | tee "$LOGS/bench-peers_kda.log"
  echo "peers_kda exit ${PIPESTATUS[0]} (bench-peers_kda.log)"
}
dsa_peers() {
  [ "${KESTREL_DSA_PEERS:-1}" = 1 ] || return 0
  echo "== peers_dsa"
  [ "${KESTREL_DSA_PEERS_BUILD:-0}" = 1 ] && bash "$ROOT/bench/gpu/build_peers_h200.sh" "$LOGS"
  # One process per section, so that a peer that crashes (DeepGEMM's paged logits segfaulted on the H200) does not
  # take the others with it; a crash is re-run under gdb, when the machine has it, for a native backtrace.
  local sections=${KESTREL_DSA_PEERS_SECTIONS:-torch_dsa_decode,torch_dense_mla_decode,flashmla_decode,deepgemm_paged,flashmla_prefill,deepgemm_prefill}
  : >"$LOGS/bench-peers_dsa.log"
  # DeepGEMM's module is built by this machine's C++ compiler (/opt/gcc on the H200), whose libstdc++ is newer than
  # the system one the Python process loads: its JIT's first std::regex then segfaulted in a collate facet looked up
  # with the compiler's facet id in the system library's locale (session 4, native_backtrace.sh). Its sections run
  # with the compiler's own libstdc++ preloaded.
  local cxx_stdlib
  cxx_stdlib=$(c++ -print-file-name=libstdc++.so.6 2>/dev/null)
  for sec in ${sections//,/ }; do
    local preload=
    [[ "$sec" == deepgemm_* && "$cxx_stdlib" == /* ]] && preload=$cxx_stdlib
    LD_PRELOAD="$preload" PYTHONUNBUFFERED=1 timeout "$BENCH_S" python3 -X faulthandler "$ROOT/bench/gpu/peers_dsa.py" --sections "$sec" 2>&1 |
      tee -a "$LOGS/bench-peers_dsa.log"
    local rc=${PIPESTATUS[0]}
    echo "peers_dsa $sec exit $rc (bench-peers_dsa.log)"
    if [ "$rc" = 139 ] && command -v gdb >/dev/null 2>&1; then
      timeout 120 gdb -batch -ex run -ex bt --args python3 "$ROOT/bench/gpu/peers_dsa.py" --sections "$sec" \
        --contexts 8192 --batches 1 >"$LOGS/gdb-peers_dsa-$sec.log" 2>&1
      echo "gdb backtrace of $sec: gdb-peers_dsa-$sec.log"
    elif [ "$rc" = 139 ] || [ "$rc" = 134 ]; then
      DG_JIT_DEBUG=1 PYTHONUNBUFFERED=1 timeout 180 bash "$ROOT/bench/gpu/native_backtrace.sh" "$LOGS/segv-peers_dsa-$sec.log" \
        'deep_gemm/_C|flash_mla/cuda' python3 "$ROOT/bench/gpu/peers_dsa.py" --sections "$sec" --contexts 8192 --batches 1 \
        --prefill-contexts 8192 --prefill-queries 1024
      echo "native backtrace of $sec (exit $?): segv-peers_dsa-$sec.log"
      grep -A3 '^resolved' "$LOGS/segv-peers_dsa-$sec.log" | head -40
    fi
  done
}
for b in "${BENCHES[@]}"; do
  echo "== $b"
  timeout "$BENCH_S" "$BIN/$b" 2>&1 | tee "$LOGS/bench-$b.log"
  rc=${PIPESTATUS[0]}
  echo "$b exit $rc"
  [ "$rc" = 0 ] || failed+=("$b")
  if [ "$b" = kda_cuda_bench ]; then kda_peers; fi
  if [ "$b" = dsa_decode_bench ]; then dsa_peers; fi
done

runs() { [ "$BENCH" = all ] || [ "$BENCH" = "$1" ]; }
SAN=$(command -v compute-sanitizer || ls "$CUDA_HOME"/bin/compute-sanitizer 2>/dev/null | head -1)
NCU=$(command -v ncu || ls "$CUDA_HOME"/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if runs kda && [ -n "$NCU" ] && [ "${KESTREL_KDA_PROFILE:-1}" = 1 ]; then
  timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$BIN/kda_cuda_bench" --profile >"$LOGS/ncu-kda.log" 2>&1
  echo "kda ncu exit $? (ncu-kda.log)"
  grep -E "kda_[a-z_]+kernel|gpu__time|dram__bytes" "$LOGS/ncu-kda.log" | sed 's/  */ /g' | tail -30
fi
DSA_MEMCHECK_S=${KESTREL_DSA_MEMCHECK_S:-75}
if runs dsa && [ -n "$SAN" ] && [ "$DSA_MEMCHECK_S" != 0 ]; then
  timeout "$DSA_MEMCHECK_S" "$SAN" --tool memcheck --error-exitcode 3 "$BIN/dsa_kernels_test" \
    --gtest_filter='DsaIndexKeyWriter.*:DsaTopk.Speculative*:*DsaIndexScores*/0:*DsaSparseMla*/4' \
    >"$LOGS/memcheck-dsa.log" 2>&1
  echo "dsa memcheck exit $? ($(grep -E 'ERROR SUMMARY' "$LOGS/memcheck-dsa.log" | tail -1))"
  if [ "${KESTREL_DSA_RACECHECK:-0}" = 1 ]; then
    timeout 45 "$SAN" --tool racecheck --error-exitcode 3 "$BIN/dsa_kernels_test" \
      --gtest_filter='DsaTopk.Speculative*:*DsaIndexScores*/1:*DsaSparseMla*/4' >"$LOGS/racecheck-dsa.log" 2>&1
    echo "dsa racecheck exit $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/racecheck-dsa.log" | tail -1))"
  fi
fi
if runs dsa && [ -n "$NCU" ] && [ "${KESTREL_DSA_PROFILE:-0}" = 1 ]; then
  timeout 90 "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy -k regex:'index_scores|topk_kernel|sparse_mla' \
    "$BIN/dsa_decode_bench" --profile >"$LOGS/ncu-dsa.txt" 2>&1
  echo "dsa ncu exit $? (ncu-dsa.txt)"
fi
MLA_SANITIZE_S=${KESTREL_MLA_SANITIZE_S:-40}
if runs mla && [ -n "$SAN" ] && [ "$MLA_SANITIZE_S" != 0 ]; then
  timeout "$MLA_SANITIZE_S" "$SAN" --tool memcheck --error-exitcode 3 "$BIN/mla_decode_test" \
    --gtest_filter='*fp8_h16_*:*bf16_h64_*:MlaDecodeArguments.*' >"$LOGS/memcheck-mla.log" 2>&1
  echo "mla memcheck exit $? ($(grep -E 'ERROR SUMMARY' "$LOGS/memcheck-mla.log" | tail -1))"
  timeout "$MLA_SANITIZE_S" "$SAN" --tool racecheck --error-exitcode 3 "$BIN/mla_decode_test" \
    --gtest_filter='*fp8_h96_*:MlaDecodeArguments.*' >"$LOGS/racecheck-mla.log" 2>&1
  echo "mla racecheck exit $? ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/racecheck-mla.log" | tail -1))"
fi
if runs mla && [ -n "$NCU" ] && [ "${KESTREL_MLA_PROFILE:-0}" = 1 ]; then
  timeout 50 "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats -k regex:'mla_decode_kernel' \
    "$BIN/mla_decode_bench" --profile >"$LOGS/ncu-mla.txt" 2>&1
  echo "mla ncu exit $? (ncu-mla.txt)"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all passed: ${TESTS[*]} ${BENCHES[*]}"
