#!/usr/bin/env bash
# Session 4, device run 2: prefill bench + prefill peers + DeepGEMM native backtrace (no tests).
cd "$(dirname "$0")/../../../.."
export NCCL_NVLS_ENABLE=0 KESTREL_KJV_TEXT=$PWD/.devdeps/kjv.txt
L=/tmp/logs; mkdir -p $L
T0=$SECONDS
tl() { echo "$1 at $((SECONDS-T0)) s" >> $L/timeline.txt; }
( while true; do sleep 30; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
KESTREL_PEERS_BUILD_S=300 bash bench/gpu/build_peers_h200.sh $L > $L/peers-build-bg.log 2>&1 &
PB=$!
bash bench/gpu/run_h200.sh --build-only $L > $L/run-build.log 2>&1
tl "build rc $?"
BIN=/tmp/kestrel-gpu-build/kestrel
timeout 100 $BIN/dsa_prefill_bench > $L/bench-dsa-prefill.log 2>&1; tl "dsa prefill rc $?"
wait $PB; tl "peers built"
DG_JIT_DEBUG=1 timeout 60 bash bench/gpu/native_backtrace.sh $L/segv-deepgemm.log 'deep_gemm/_C' \
  python3 bench/gpu/peers_dsa.py --sections deepgemm_paged --contexts 8192 --batches 1
tl "deepgemm paged rc $?"
for sec in flashmla_prefill deepgemm_prefill; do
  PYTHONUNBUFFERED=1 timeout 80 python3 -X faulthandler bench/gpu/peers_dsa.py --sections $sec >> $L/bench-peers_dsa.log 2>&1
  tl "peer $sec rc $?"
done
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
