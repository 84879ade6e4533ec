#!/usr/bin/env bash
# Session 4, device run 1: all GPU tests of main (h-next merged) + peers build in background, then benches.
cd "$(dirname "$0")/../../../.."
export NCCL_NVLS_ENABLE=0 KESTREL_KJV_TEXT=$PWD/.devdeps/kjv.txt
L=/tmp/logs; mkdir -p $L
T0=$SECONDS
( while true; do sleep 30; tar czf $OUT/logs.tgz -C /tmp logs 2>/dev/null; done ) &
TARPID=$!
command -v gdb > $L/has-gdb.txt 2>&1; echo "gdb rc $?" >> $L/has-gdb.txt
KESTREL_PEERS_BUILD_S=300 bash bench/gpu/build_peers_h200.sh $L > $L/peers-build-bg.log 2>&1 &
PB=$!
KESTREL_GPU_TEST_S=270 bash bench/gpu/run_h200.sh --tests-only $L > $L/run-tests.log 2>&1
echo "tests done at $((SECONDS-T0)) s rc $?" >> $L/timeline.txt
BIN=/tmp/kestrel-gpu-build/kestrel
timeout 70 $BIN/dsa_decode_bench --v32 > $L/bench-dsa-v32.log 2>&1; echo "dsa v32 rc $? at $((SECONDS-T0))" >> $L/timeline.txt
wait $PB; echo "peers built at $((SECONDS-T0))" >> $L/timeline.txt
for sec in torch_dsa_decode torch_dense_mla_decode flashmla_decode; do
  PYTHONUNBUFFERED=1 timeout 60 python3 -X faulthandler bench/gpu/peers_dsa.py --sections $sec >> $L/bench-peers_dsa.log 2>&1
  echo "peer $sec rc $? at $((SECONDS-T0))" >> $L/timeline.txt
done
DG_JIT_DEBUG=1 DG_JIT_PRINT_COMPILER_COMMAND=1 PYTHONUNBUFFERED=1 timeout 45 python3 -X faulthandler bench/gpu/peers_dsa.py --sections deepgemm_paged --contexts 8192 --batches 1 > $L/peer-deepgemm.log 2>&1
rc=$?; echo "peer deepgemm rc $rc at $((SECONDS-T0))" >> $L/timeline.txt
if [ $rc = 139 ] && command -v gdb >/dev/null; then
  DG_JIT_DEBUG=1 timeout 60 gdb -batch -ex run -ex bt --args python3 bench/gpu/peers_dsa.py --sections deepgemm_paged --contexts 8192 --batches 1 > $L/gdb-deepgemm.log 2>&1
fi
timeout 60 $BIN/gemm_fp8_bench > $L/bench-gemm_fp8.log 2>&1; echo "gemm rc $? at $((SECONDS-T0))" >> $L/timeline.txt
timeout 90 $BIN/model_step_bench > $L/bench-model_step.log 2>&1; echo "model rc $? at $((SECONDS-T0))" >> $L/timeline.txt
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
