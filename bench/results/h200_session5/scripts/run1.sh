#!/usr/bin/env bash
# Session 5, device run 1: h-next2 merged (fast_fp8 on e4m3 wgmma, sparse wgmma MLA without slack, topk_decode_bounded);
# its tests, then every DSA benchmark and every DSA peer (PyTorch, FlashMLA, DeepGEMM) in this one call.
cd "$(dirname "$0")/../../../.."
export NCCL_NVLS_ENABLE=0 KESTREL_KJV_TEXT=$PWD/.devdeps/kjv.txt
export PATH=/usr/local/cuda/bin:$PATH
L=/tmp/logs; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
( while true; do sleep 15; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
KESTREL_PEERS_BUILD_S=300 bash bench/gpu/build_peers_h200.sh $L > $L/peers-build-bg.log 2>&1 &
PB=$!
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $L/gpu.txt 2>&1
B=/tmp/kestrel-gpu-build/kestrel
{ cmake -S bench/gpu -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$PWD/.devdeps \
    -DKESTREL_GTEST_SOURCE_DIR=$PWD/.devdeps/googletest && \
  cmake --build $B -j16 --target dsa_kernels_test dsa_candidates_test dsa_decode_bench dsa_prefill_bench mla_decode_bench; } > $L/build.log 2>&1
tl "build rc $?"
timeout 60 $B/dsa_candidates_test > $L/test-dsa_candidates_test.log 2>&1; tl "dsa_candidates_test rc $?"
timeout 90 $B/dsa_kernels_test > $L/test-dsa_kernels_test.log 2>&1; tl "dsa_kernels_test rc $?"
for c in 131072 32768 8192; do timeout 40 $B/dsa_decode_bench $c > $L/bench-dsa-kimi-$c.log 2>&1; tl "dsa kimi $c rc $?"; done
timeout 40 $B/dsa_decode_bench --v32 131072 > $L/bench-dsa-v32-131072.log 2>&1; tl "dsa v32 rc $?"
timeout 60 $B/dsa_prefill_bench > $L/bench-dsa-prefill.log 2>&1; tl "dsa prefill rc $?"
timeout 60 $B/mla_decode_bench > $L/bench-mla-decode.log 2>&1; tl "mla decode rc $?"
wait $PB; tl "peers built"
LIBCXX=$(c++ -print-file-name=libstdc++.so.6)
P="python3 bench/gpu/peers_dsa.py"
export PYTHONUNBUFFERED=1
timeout 60 $P --sections torch_dsa_decode --contexts 131072 > $L/peer-torch.log 2>&1; tl "torch dsa rc $?"
timeout 60 $P --sections flashmla_decode > $L/peer-flashmla-decode.log 2>&1; tl "flashmla decode rc $?"
timeout 60 $P --sections flashmla_prefill > $L/peer-flashmla-prefill.log 2>&1; tl "flashmla prefill rc $?"
LD_PRELOAD=$LIBCXX timeout 60 $P --sections deepgemm_paged > $L/peer-deepgemm-paged.log 2>&1; tl "deepgemm paged rc $?"
LD_PRELOAD=$LIBCXX timeout 60 $P --sections deepgemm_prefill > $L/peer-deepgemm-prefill.log 2>&1; tl "deepgemm prefill rc $?"
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
