#!/usr/bin/env bash
# Builds the DSA peers of bench/gpu/peers_dsa.py on the H200 device machine (nvcc 13, g++ 13, python3 with torch,
# no network) from the source in .peers/ (bench/gpu/make_peers.sh; carry `.peers`):
# - FlashMLA: its own setup.py, `python3 setup.py build_ext --inplace`, for sm_90a only (FLASH_MLA_DISABLE_SM100=1;
#   its sm100 files are still compiled, their device code compiled out), MAX_JOBS = the core count, CUTLASS at the
#   commit it pins linked in as csrc/cutlass, CUDA 13's include/cccl on the host compiler's include path (g++ compiles
#   csrc/api/api.cpp, which includes CUTLASS). setup.py's git calls (submodule update, version) meet a `git` that
#   always fails, so they touch nothing and the version falls back to a date.
# - DeepGEMM: the one C++ module its setup.py builds (deep_gemm._C from csrc/python_api.cpp, same include dirs,
#   libraries and flags as its get_ext_modules(), plus -g for bench/gpu/native_backtrace.sh's addr2line and an rpath
#   to CUDA's lib64 for libnvrtc), built in place
#   without the wheel/packaging steps of its setup.py (which import `wheel` and a stub generator); the cute/ and
#   cutlass/ header trees linked into deep_gemm/include/ as its develop.sh does, because its JIT compiles kernels
#   with nvcc -I deep_gemm/include only. The kernels themselves are compiled by that JIT on first use, in
#   bench/gpu/peers_dsa.py (cache: DG_JIT_CACHE_DIR, set there to <build>/deepgemm-jit).
# Both builds run at once (FlashMLA on all cores, DeepGEMM's single file beside it), each capped at
# KESTREL_PEERS_BUILD_S seconds (default 360; timeout signals the whole process group, so ninja's nvcc jobs stop
# too), then each is imported once as a check (capped at 120 s).
#
# Usage: bench/gpu/build_peers_h200.sh [log-dir]     (log dir default $OUT, else ./out-gpu)
#   KESTREL_PEERS_BUILD: the build folder (default build-peers/ in the repository: git-ignored and not carried, so
#   a warm device machine keeps it between calls; a peer whose COMMIT matches a finished build there is reused, an
#   unfinished one of the same commit carries on).
# Writes build-flashmla.log, build-deepgemm.log and peers-import.log to the log dir and one line per peer,
# `peer-build <peer> ok|failed|reused ...`. Never fails the calling script: exits 0 whatever happened.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 0
ROOT=$PWD
LOGS=${1:-${OUT:-$ROOT/out-gpu}}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
WORK=${KESTREL_PEERS_BUILD:-$ROOT/build-peers}
CAP=${KESTREL_PEERS_BUILD_S:-360}
SRC=$ROOT/.peers
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
if ! command -v nvcc >/dev/null 2>&1 || ! command -v python3 >/dev/null 2>&1; then
  echo "peer-build all failed: nvcc or python3 missing"
  exit 0
fi
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
export CUDA_HOME
JOBS=$(nproc)
mkdir -p "$WORK/shim"
printf '#!/bin/sh\nexit 1\n' >"$WORK/shim/git"
chmod +x "$WORK/shim/git"

# The built module of a peer: flash_mla/cuda*.so, deep_gemm/_C*.so.
built_module() {
  case $1 in
    flashmla) compgen -G "$WORK/flashmla/flash_mla/cuda*.so" | head -1 ;;
    deepgemm) compgen -G "$WORK/deepgemm/deep_gemm/_C*.so" | head -1 ;;
  esac
}

# What a build of PEER depends on besides its commit: a finished build with another tag is built again.
build_tag() {
  case $1 in
    deepgemm) echo "cxx -g" ;;
    *) echo "base" ;;
  esac
}

# stage PEER: copies .peers/PEER-src to the build folder and links its CUTLASS in (unpacked once per commit).
# Returns 2 when a finished build of the same commit is already there, 1 on an error. An unfinished build of the
# same commit (one that ran out of time) is kept, so that ninja carries on where it stopped.
stage() {
  local peer=$1 src=$SRC/$1-src dst=$WORK/$1 cut sha
  if [ ! -f "$src/COMMIT" ] || [ ! -f "$src/CUTLASS_COMMIT" ]; then
    echo "no $src (run bench/gpu/make_peers.sh here and carry .peers)"
    return 1
  fi
  if [ -f "$dst/COMMIT" ] && cmp -s "$src/COMMIT" "$dst/COMMIT"; then
    local module tag
    module=$(built_module "$peer")
    if [ -n "$module" ]; then
      tag=$(cat "$dst/BUILD_TAG" 2>/dev/null || echo base)
      [ "$tag" = "$(build_tag "$peer")" ] && return 2
      echo "built as '$tag', wanted '$(build_tag "$peer")': building again"
      rm -f "$module"  # else setuptools skips an up-to-date module
    fi
    echo "resuming the unfinished build in $dst"
    return 0
  fi
  sha=$(cat "$src/CUTLASS_COMMIT")
  cut=$WORK/cutlass/$sha
  if [ ! -f "$cut/.unpacked" ]; then
    rm -rf "$cut"
    mkdir -p "$cut"
    tar -xzf "$SRC/cutlass/$sha.tar.gz" -C "$cut" || return 1
    touch "$cut/.unpacked"
  fi
  rm -rf "$dst"
  cp -a "$src" "$dst" || return 1
  rm -f "$dst/COMMIT"  # written back last: its presence marks a complete staging
  # Relative links, so that the build folder still works if the repository sits elsewhere in a later call.
  case $peer in
    flashmla) ln -sfn "../../cutlass/$sha" "$dst/csrc/cutlass" ;;
    deepgemm)
      ln -sfn "../../cutlass/$sha" "$dst/third-party/cutlass"
      ln -sfn "../../../cutlass/$sha/include/cute" "$dst/deep_gemm/include/cute"
      ln -sfn "../../../cutlass/$sha/include/cutlass" "$dst/deep_gemm/include/cutlass"
      ;;
  esac
  cp "$src/COMMIT" "$dst/COMMIT"
}

build_flashmla() {
  cd "$WORK/flashmla" || return 1
  env PATH="$WORK/shim:$PATH" FLASH_MLA_DISABLE_SM100=1 MAX_JOBS="$JOBS" TORCH_CUDA_ARCH_LIST=9.0a \
    CPLUS_INCLUDE_PATH="$CUDA_HOME/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    timeout "$CAP" python3 setup.py build_ext --inplace
}

build_deepgemm() {
  cd "$WORK/deepgemm" || return 1
  timeout "$CAP" python3 - <<'PY'
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

# DeepGEMM's setup.py get_ext_modules(): same source, include dirs (made absolute: ninja compiles from the build
# folder), libraries and flags.
# Plus -g (ours, build_tag): the frames of a crash inside deep_gemm._C resolve to lines (native_backtrace.sh).
cxx_flags = ['-std=c++17', '-O3', '-fPIC', '-Wno-psabi', '-Wno-deprecated-declarations',
             f'-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}', '-g']
include_dirs = [f'{CUDA_HOME}/include', f'{CUDA_HOME}/include/cccl'] + [
    os.path.abspath(d) for d in ('deep_gemm/include', 'third-party/cutlass/include', 'third-party/fmt/include')]
setup(name='deep_gemm',
      ext_modules=[CUDAExtension(name='deep_gemm._C', sources=['csrc/python_api.cpp'], include_dirs=include_dirs,
                                 libraries=['cudart', 'nvrtc'], library_dirs=[f'{CUDA_HOME}/lib64'],
                                 extra_compile_args=cxx_flags,
                                 extra_link_args=[f'-Wl,-rpath,{CUDA_HOME}/lib64'])],
      cmdclass={'build_ext': BuildExtension},
      script_args=['build_ext', '--inplace'])
PY
}

{
  date -u
  nvcc --version | tail -2
  c++ --version | head -1
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "jobs $JOBS, cap $CAP s, build folder $WORK"
} >"$LOGS/build-peers-env.txt" 2>&1

declare -A state pid
start_s=$SECONDS
for peer in flashmla deepgemm; do
  stage "$peer" >"$LOGS/build-$peer.log" 2>&1
  case $? in
    0)
      state[$peer]=built
      if [ "$peer" = flashmla ]; then build_flashmla; else build_deepgemm; fi >>"$LOGS/build-$peer.log" 2>&1 &
      pid[$peer]=$!
      ;;
    2) state[$peer]=reused ;;
    *) state[$peer]=failed ;;
  esac
done
for peer in flashmla deepgemm; do
  rc=0
  if [ "${state[$peer]}" = built ]; then
    wait "${pid[$peer]}"
    rc=$?
  fi
  module=$(built_module "$peer")
  if [ "${state[$peer]}" = reused ]; then
    echo "peer-build $peer reused commit=$(cat "$WORK/$peer/COMMIT") module=$module"
  elif [ "${state[$peer]}" = built ] && [ "$rc" = 0 ] && [ -n "$module" ]; then
    build_tag "$peer" >"$WORK/$peer/BUILD_TAG"
    echo "peer-build $peer ok commit=$(cat "$WORK/$peer/COMMIT") seconds=$((SECONDS - start_s)) module=$module"
  else
    if [ "${state[$peer]}" = failed ]; then
      why="source not staged"
    elif [ "$rc" = 124 ]; then
      why="timed out after $CAP s"
    else
      why="exit $rc"
    fi
    echo "peer-build $peer failed ($why; build-$peer.log):"
    grep -E "error|Error|No such file" "$LOGS/build-$peer.log" | grep -v "^\s*$" | head -15 | sed 's/^/  /'
    tail -3 "$LOGS/build-$peer.log" | sed 's/^/  /'
  fi
done

# One import of each built peer, so that a module that built but does not load shows here.
{
  [ -n "$(built_module flashmla)" ] && (cd "$WORK/flashmla" && timeout 120 python3 -c \
    'import flash_mla, flash_mla.cuda; print("flashmla import ok", flash_mla.cuda.__file__)')
  [ -n "$(built_module deepgemm)" ] && (cd "$WORK/deepgemm" && DG_JIT_CACHE_DIR="$WORK/deepgemm-jit" timeout 120 \
    python3 -c 'import deep_gemm; print("deepgemm import ok", deep_gemm._C.__file__, "sms", deep_gemm.get_num_sms())')
} >"$LOGS/peers-import.log" 2>&1
grep -E "import ok|Error|error" "$LOGS/peers-import.log" | head -10 | sed 's/^/peer-build check: /'
exit 0
