#!/usr/bin/env bash
# The real-size runs of the loading work on one H200 (after bench/gpu/run_h200.sh built build-h200/), each with its
# command in the log:
#   kl48  Kimi-Linear-48B-A3B at full size (27 layers, bf16, --load-format dummy): loads on one GPU, serves a streamed
#         chat request; load time, peak host RSS and the GPU memory split.
#   ds6   DeepSeek-V3.2 at real width, --hf-overrides '{"num_hidden_layers": 6}', FP8 weights (dummy): bytes on the
#         GPU against the checkpoint's.
#   k31   K3.1-Pro width (make-model's k3.1-pro config, 4 layers, all 896 experts, dummy) with MXFP4 experts.
#   json  Structured output's serving cost on the GPU: Kimi-Linear-48B width, 4 layers (dummy), 64 requests at once,
#         free text against a JSON-schema response_format (bench/gpu/structured_serve.py).
#   itl   The step budget (--max-itl-factor): DeepSeek-V3.2 width, 2 layers (one MoE), dummy FP8 weights, 64 streams
#         of 2048-token prompts and 128 output tokens (192 requests, so prompts keep arriving beside running decodes),
#         --max-num-batched-tokens 8192; `kestrel bench serve` with the factor off (0), at 2 and at 4 (or
#         KESTREL_ITL_FACTORS): ITL p50/p99, TTFT.
#   disk  A ~15.8 GB safetensors checkpoint (DeepSeek-V3.2 width, 2 layers, one of them MoE, FP8) written with
#         make-model --dummy-weights, dropped from the page cache, then loaded from disk: GB/s and peak host RSS.
# Usage: bench/gpu/real_size_h200.sh [kl48,ds6,k31,json,itl,disk] [log-dir]    (default: all, $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RUNS=${1:-kl48,ds6,k31,json,itl,disk}
LOGS=${2:-${OUT:-$ROOT/out-gpu}}
mkdir -p "$LOGS"
K=$ROOT/build-h200/src/kestrel
export KESTREL_KJV_TEXT=$ROOT/.devdeps/kjv.txt
export LD_LIBRARY_PATH=$ROOT/.devdeps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=${KESTREL_REAL_DIR:-/tmp/kestrel-real}
mkdir -p "$W"
failed=()
step() {  # name, command...
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee -a "$LOGS/real-$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc"
  [ "$rc" = 0 ] || failed+=("$name")
}
# Peak RSS and wall time of a command (its children included), one JSON line.
measured() {
  python3 - "$@" <<'PY'
import json, resource, subprocess, sys, time
t = time.time()
rc = subprocess.call(sys.argv[1:])
print(json.dumps({"wall_s": round(time.time() - t, 2),
                  "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 3),
                  "exit": rc}))
sys.exit(rc)
PY
}
has() { [[ ",$RUNS," == *",$1,"* ]]; }

if has kl48; then
  step kl48-make "$K" make-model --arch kimi_linear --preset kimi-linear-48b --out "$W/kl48" --tokenizer
  step kl48 python3 "$ROOT/bench/gpu/serve_once.py" "$K" "$W/kl48" 8131 --load-format dummy --device cuda \
    --gpu-memory-utilization 0.95 --max-model-len 8192 --max-num-seqs 16
fi
if has ds6; then
  step ds6-make "$K" make-model --arch deepseek_v32 --preset deepseek-v3.2 --out "$W/ds" --tokenizer
  step ds6 measured "$K" generate "$W/ds" --load-format dummy --hf-overrides '{"num_hidden_layers": 6}' --device cuda \
    --gpu-memory-utilization 0.95 --max-model-len 4096 --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 8
fi
if has k31; then
  step k31-make "$K" make-model --arch kimi_k3 --preset k3.1-pro --out "$W/k31" --tokenizer
  step k31 measured "$K" generate "$W/k31" --load-format dummy --hf-overrides '{"num_hidden_layers": 4}' --device cuda \
    --gpu-memory-utilization 0.95 --max-model-len 4096 --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 8
fi
if has json; then
  [ -f "$W/kl48/config.json" ] || step kl48-make "$K" make-model --arch kimi_linear --preset kimi-linear-48b \
    --out "$W/kl48" --tokenizer
  step json python3 "$ROOT/bench/gpu/structured_serve.py" "$K" "$W/kl48" 8132 --batch 64 --rounds 3 --max-tokens 128 \
    -- --load-format dummy --hf-overrides '{"num_hidden_layers": 4}' --device cuda --gpu-memory-utilization 0.9 \
    --max-model-len 4096 --max-num-seqs 64
fi
if has itl; then
  [ -f "$W/ds/config.json" ] || step ds6-make "$K" make-model --arch deepseek_v32 --preset deepseek-v3.2 --out "$W/ds" \
    --tokenizer
  for f in ${KESTREL_ITL_FACTORS:-0 2 4}; do
    "$K" serve "$W/ds" --port 8140 --load-format dummy --hf-overrides '{"num_hidden_layers": 2, "first_k_dense_replace": 1}' \
      --device cuda --gpu-memory-utilization 0.9 --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 8192 \
      --max-itl-factor "$f" >"$LOGS/real-itl-serve-$f.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8140/health', timeout=1)" \
        2>/dev/null && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    step "itl-$f" "$K" bench serve --port 8140 --dataset random --num-prompts 192 --max-concurrency 64 \
      --random-input-len 2048 --random-output-len 128 --ignore-eos --seed 1 --save-result "$LOGS/real-itl-$f.json"
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
fi
if has disk; then
  rm -rf "$W/ds15"
  step disk-make measured "$K" make-model --arch deepseek_v32 --preset deepseek-v3.2 --out "$W/ds15" --tokenizer \
    --dummy-weights --hf-overrides '{"num_hidden_layers": 2, "first_k_dense_replace": 1}'
  du -sb "$W/ds15"/*.safetensors | tee -a "$LOGS/real-disk.log"
  # Out of the page cache: written back, then dropped (posix_fadvise), so that the load reads the disk.
  python3 - "$W/ds15" <<'PY' 2>&1 | tee -a "$LOGS/real-disk.log"
import glob, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
try:
    open("/proc/sys/vm/drop_caches", "w").write("1\n")
    print("page cache dropped (drop_caches and fadvise)")
except OSError as e:
    print("fadvise only:", e)
PY
  step disk measured "$K" generate "$W/ds15" --device cuda --gpu-memory-utilization 0.95 --max-model-len 4096 \
    --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 4
  # The disk's own ceiling, for the load's figure: the same shards read with O_DIRECT (no page cache), one reader per
  # shard at once and then one shard after another, 16 MiB requests.
  python3 - "$W/ds15" <<'PY' 2>&1 | tee -a "$LOGS/real-disk.log"
import glob, mmap, os, sys, threading, time
files = sorted(glob.glob(sys.argv[1] + "/*.safetensors"))
def read(f, out):
    fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 16 << 20)
    n = 0
    while True:
        r = os.readv(fd, [buf])
        n += r
        if r < len(buf):
            break
    os.close(fd)
    out.append(n)
for mode in ("parallel", "sequential"):
    got, t = [], time.time()
    if mode == "parallel":
        ts = [threading.Thread(target=read, args=(f, got)) for f in files]
        [x.start() for x in ts]
        [x.join() for x in ts]
    else:
        for f in files:
            read(f, got)
    dt = time.time() - t
    print(f"raw disk read, O_DIRECT, {mode}: {sum(got) / 2**30:.2f} GiB in {dt:.2f} s = "
          f"{sum(got) / 2**30 / dt:.2f} GiB/s ({sum(got) / 1e9 / dt:.2f} GB/s)")
PY
fi
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
echo "all real-size runs passed"
