#!/usr/bin/env bash
# Session 5, device run 6: topk_decode_bounded with the rewritten key-norm and query-mass kernels (tests and the
# bench's bounded columns), then the GPU tests not run since e70f36f moved their shared host code:
# gpu_fp8_model_test and the Kimi Linear cases of gpu_model_test.
cd "$(dirname "$0")/../../../.."
export NCCL_NVLS_ENABLE=0 KESTREL_KJV_TEXT=$PWD/.devdeps/kjv.txt
export PATH=/usr/local/cuda/bin:$PATH
L=/tmp/logs; rm -rf $L; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
( while true; do sleep 10; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
B=/tmp/kestrel-gpu-build/kestrel
{ cmake -S bench/gpu -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$PWD/.devdeps \
    -DKESTREL_GTEST_SOURCE_DIR=$PWD/.devdeps/googletest && \
  cmake --build $B -j16 --target dsa_candidates_test dsa_decode_bench gpu_fp8_model_test gpu_model_test; } > $L/build.log 2>&1
tl "build rc $?"
timeout 60 $B/dsa_candidates_test > $L/test-dsa_candidates_test.log 2>&1; tl "dsa_candidates_test rc $?"
timeout 60 $B/dsa_decode_bench 131072 > $L/bench-dsa-kimi-131072.log 2>&1; tl "dsa kimi rc $?"
timeout 60 $B/gpu_fp8_model_test > $L/test-gpu_fp8_model_test.log 2>&1; tl "gpu_fp8_model_test rc $?"
timeout 120 $B/gpu_model_test --gtest_filter='KimiLinear/*' > $L/test-gpu_model_test-kimi_linear.log 2>&1
tl "gpu_model_test kimi_linear rc $?"
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
