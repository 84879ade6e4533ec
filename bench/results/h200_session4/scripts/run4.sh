#!/usr/bin/env bash
# Session 4, device run 4 (final): the engine's kernel choice (mma.sync sparse MLA, wgmma exact scores from 64 rows),
# the far-above-2048 tests with the reference-spread bound, the DSA model tests, DeepGEMM with the compiler's libstdc++.
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
B=/tmp/kestrel-gpu-build/kestrel
{ cmake -S bench/gpu -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$PWD/.devdeps \
    -DKESTREL_GTEST_SOURCE_DIR=$PWD/.devdeps/googletest && cmake --build $B -j16 --target dsa_kernels_test gpu_model_test; } > $L/build.log 2>&1
tl "build rc $?"
timeout 60 $B/dsa_kernels_test > $L/test-dsa_kernels_test.log 2>&1; tl "dsa_kernels_test rc $?"
timeout 200 $B/gpu_model_test --gtest_filter='Models/*' > $L/test-gpu_model_test-farabove.log 2>&1; tl "far-above rc $?"
timeout 200 $B/gpu_model_test --gtest_filter='KimiK3/*:DeepseekV32/*:Small/*' > $L/test-gpu_model_test-dsa.log 2>&1; tl "dsa model tests rc $?"
wait $PB; tl "peers built"
{ c++ --version | head -1; c++ -print-file-name=libstdc++.so.6; ls -la "$(c++ -print-file-name=libstdc++.so.6)"; ldd build-peers/deepgemm/deep_gemm/_C*.so | grep -E "stdc|torch_python"; } > $L/deepgemm-env.txt 2>&1
LIBCXX=$(c++ -print-file-name=libstdc++.so.6)
LD_PRELOAD=$LIBCXX PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu/peers_dsa.py --sections deepgemm_paged --contexts 131072 --batches 1,32 > $L/peer-deepgemm.log 2>&1; tl "deepgemm paged rc $?"
LD_PRELOAD=$LIBCXX PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu/peers_dsa.py --sections deepgemm_prefill --prefill-contexts 131072 --prefill-queries 4096 >> $L/peer-deepgemm.log 2>&1; tl "deepgemm prefill rc $?"
kill $TARPID; tar czf $OUT/logs.tgz -C /tmp logs
