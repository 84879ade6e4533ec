#!/usr/bin/env bash
# Session 4, device run 3: wgmma exact scores + wgmma sparse MLA: tests, DSA benches, peers, DSA model tests.
cd "$(dirname "$0")/../../../.."
export NCCL_NVLS_ENABLE=0 KESTREL_KJV_TEXT=$PWD/.devdeps/kjv.txt
L=/tmp/logs; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
( while true; do sleep 20; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
KESTREL_PEERS_BUILD_S=300 bash bench/gpu/build_peers_h200.sh $L > $L/peers-build-bg.log 2>&1 &
PB=$!
KESTREL_GPU_TEST_FILTER='^(dsa_kernels_test)$' KESTREL_GPU_TEST_S=120 bash bench/gpu/run_h200.sh --tests-only $L > $L/run-tests.log 2>&1
tl "dsa_kernels_test rc $?"
BIN=/tmp/kestrel-gpu-build/kestrel
timeout 60 $BIN/dsa_decode_bench --v32 > $L/bench-dsa-v32.log 2>&1; tl "dsa v32 rc $?"
timeout 60 $BIN/dsa_decode_bench > $L/bench-dsa.log 2>&1; tl "dsa kimi rc $?"
timeout 60 $BIN/dsa_prefill_bench > $L/bench-dsa-prefill.log 2>&1; tl "dsa prefill rc $?"
wait $PB; tl "peers built"
PYTHONUNBUFFERED=1 timeout 40 python3 bench/gpu/peers_dsa.py --sections flashmla_decode --contexts 131072 >> $L/bench-peers_dsa.log 2>&1; tl "flashmla decode rc $?"
PYTHONUNBUFFERED=1 timeout 40 python3 bench/gpu/peers_dsa.py --sections torch_dsa_decode --contexts 131072 >> $L/bench-peers_dsa.log 2>&1; tl "torch dsa rc $?"
DG_JIT_DEBUG=1 timeout 90 bash bench/gpu/native_backtrace.sh $L/segv-deepgemm.log 'deep_gemm/_C' \
  python3 bench/gpu/peers_dsa.py --sections deepgemm_paged --contexts 131072
tl "deepgemm paged rc $?"
PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu/peers_dsa.py --sections deepgemm_prefill >> $L/bench-peers_dsa.log 2>&1; tl "deepgemm prefill rc $?"
timeout 280 $BIN/gpu_model_test --gtest_filter='KimiK3/*:DeepseekV32/*:Small/*:Models/*' > $L/test-gpu_model_test.log 2>&1
tl "gpu_model_test rc $?"
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
