#!/usr/bin/env bash
# Session 5, device run 4: the final kernels' DSA step against the dense MLA step (mla_decode_bench, both in this
# run), and the DSA step at 8K, 32K and 128K (Kimi entry) and 128K (deepseek_v32 entry).
cd "$(dirname "$0")/../../../.."
export PATH=/usr/local/cuda/bin:$PATH
L=/tmp/logs; rm -rf $L; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
B=/tmp/kestrel-gpu-build/kestrel
{ cmake -S bench/gpu -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$PWD/.devdeps \
    -DKESTREL_GTEST_SOURCE_DIR=$PWD/.devdeps/googletest && \
  cmake --build $B -j16 --target mla_decode_bench dsa_decode_bench; } > $L/build.log 2>&1
tl "build rc $?"
timeout 90 $B/mla_decode_bench > $L/bench-mla-decode.log 2>&1; tl "mla decode rc $?"
for c in 32768 8192; do timeout 40 $B/dsa_decode_bench $c > $L/bench-dsa-kimi-$c.log 2>&1; tl "dsa kimi $c rc $?"; done
timeout 40 $B/dsa_decode_bench --v32 131072 > $L/bench-dsa-v32-131072.log 2>&1; tl "dsa v32 rc $?"
tar czf $OUT/logs.tgz -C /tmp logs
