#!/usr/bin/env bash
# Session 5, device run 2: the wgmma sparse MLA as the engine's kernel on the H200 (SparseMlaKernel::automatic), the
# bounded exact top-k (topk_decode_bounded) timed and compared at full size, the DSA model tests, the decode peers.
cd "$(dirname "$0")/../../../.."
export NCCL_NVLS_ENABLE=0 KESTREL_KJV_TEXT=$PWD/.devdeps/kjv.txt
export PATH=/usr/local/cuda/bin:$PATH
L=/tmp/logs; rm -rf $L; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
( while true; do sleep 15; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
KESTREL_PEERS_BUILD_S=300 bash bench/gpu/build_peers_h200.sh $L > $L/peers-build-bg.log 2>&1 &
PB=$!
B=/tmp/kestrel-gpu-build/kestrel
{ cmake -S bench/gpu -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$PWD/.devdeps \
    -DKESTREL_GTEST_SOURCE_DIR=$PWD/.devdeps/googletest && \
  cmake --build $B -j16 --target dsa_kernels_test dsa_decode_bench gpu_model_test; } > $L/build.log 2>&1
tl "build rc $?"
timeout 60 $B/dsa_decode_bench 131072 > $L/bench-dsa-kimi-131072.log 2>&1; tl "dsa kimi rc $?"
timeout 60 $B/dsa_decode_bench --v32 131072 > $L/bench-dsa-v32-131072.log 2>&1; tl "dsa v32 rc $?"
timeout 60 $B/dsa_kernels_test > $L/test-dsa_kernels_test.log 2>&1; tl "dsa_kernels_test rc $?"
timeout 300 $B/gpu_model_test --gtest_filter='KimiK3/*:DeepseekV32/*:Small/*:Models/*' > $L/test-gpu_model_test-dsa.log 2>&1
tl "gpu_model_test dsa rc $?"
wait $PB; tl "peers built"
export PYTHONUNBUFFERED=1
P="python3 bench/gpu/peers_dsa.py"
timeout 60 $P --sections torch_dsa_decode --contexts 131072 > $L/peer-torch.log 2>&1; tl "torch dsa rc $?"
timeout 60 $P --sections flashmla_decode --contexts 131072 > $L/peer-flashmla-decode.log 2>&1; tl "flashmla decode rc $?"
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
