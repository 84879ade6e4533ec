#!/usr/bin/env bash
# Session 5, device run 5: Nsight Compute profiles of one DSA decode step's kernels (final kernels) at B = 32 and
# B = 1 (L = 128K, H = 128, H_I = 64): the exact and FP8 score kernels, the top-k, both sparse MLA kernels and
# topk_decode_bounded's kernels -- where the time goes.
cd "$(dirname "$0")/../../../.."
export PATH=/usr/local/cuda/bin:$PATH
L=/tmp/logs; rm -rf $L; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
( while true; do sleep 15; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
B=/tmp/kestrel-gpu-build/kestrel
{ cmake -S bench/gpu -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$PWD/.devdeps \
    -DKESTREL_GTEST_SOURCE_DIR=$PWD/.devdeps/googletest && cmake --build $B -j16 --target dsa_decode_bench; } > $L/build.log 2>&1
tl "build rc $?"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" >> $L/timeline.txt
for b in 32 1; do
  timeout 200 "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --metrics sm__inst_executed.sum,smsp__inst_executed.avg.per_cycle_active \
    -k regex:'index_scores|topk|sparse_mla|split_combine|combine|key_norm|lower_end|threshold|candidate|rescore|map_back|query_mass' \
    $B/dsa_decode_bench --profile --batch $b > $L/ncu-dsa-b$b.txt 2>&1
  tl "ncu B=$b rc $?"
done
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
