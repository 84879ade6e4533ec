#!/usr/bin/env bash
# Makes .peers/, the source of the peer libraries that the GPU benchmarks time side by side with Kestrel's kernels,
# from local git mirrors. The H200 device machine has torch, triton, nvcc and CMake but no network, so the source
# travels with the device call: run this once here, then carry `.peers` (with `.devdeps`). The folder is git-ignored
# through .git/info/exclude and never committed; the peers' code is run as peers, never copied into Kestrel.
#
# - fla-src/: the `fla` package (pure Python + Triton) and LICENSE of flash-linear-attention at the mirror's HEAD,
#   for bench/gpu/peers_kda.py.
# - flashmla-src/: FlashMLA at the mirror's HEAD, what its setup.py compiles (setup.py, csrc/ without the CUTLASS
#   submodule, flash_mla/) plus tests/quant.py (its reference quantiser of the 656-byte FP8 KV layout, which
#   bench/gpu/peers_dsa.py uses to build the cache) and LICENSE. The sm100 sources stay: setup.py compiles them
#   whatever the target architecture and the Python module's entry points reference them.
# - deepgemm-src/: DeepGEMM at the mirror's HEAD, what its C++ module and JIT need (setup.py, csrc/, deep_gemm/ with
#   its kernel headers) and LICENSE, plus third-party/fmt/include from the fmt commit DeepGEMM pins.
# - cutlass/<commit>.tar.gz: CUTLASS's include/ and tools/util/include/ (headers only; about 27 MB unpacked, 2.3 MB
#   packed) at the commit each peer pins as a git submodule. FlashMLA and DeepGEMM pin different commits, and two
#   unpacked trees would not fit the 64 MB a device call carries, so they travel packed and
#   bench/gpu/build_peers_h200.sh unpacks them there. Where the mirror lacks a pinned commit, the newest v4.x tag
#   is used instead and said so.
# Each peer folder has COMMIT (its own commit); the DSA peers also CUTLASS_PINNED (the submodule's commit) and
# CUTLASS_COMMIT (the commit packed for it; the same unless the mirror lacked the pin).
#
# Usage: bench/gpu/make_peers.sh [fla-mirror-git-dir]
#   The other mirrors' git directories come from FLASHMLA_MIRROR, DEEPGEMM_MIRROR, CUTLASS_MIRROR and FMT_MIRROR;
#   each defaults to /work/.mirror/<owner>+<name>/repo (or /work/.mirror/<owner>+<name>). A missing DSA mirror
#   leaves that peer out with a message and exit status 1, after the others are made.
# .peers plus .devdeps must stay under 55 MB (a device call carries at most 64 MB in all); the script checks it.
set -euo pipefail

# git on a mirror, read-only: no automatic gc or maintenance (they would write into the mirror).
mgit() { git -c gc.auto=0 -c maintenance.auto=false --git-dir="$1" "${@:2}"; }
has_head() { mgit "$1" rev-parse --verify -q HEAD >/dev/null 2>&1; }

# find_mirror OWNER+NAME [GIVEN]: prints the absolute git directory of a mirror, or fails.
find_mirror() {
  local d
  for d in ${2:+"$2"} "/work/.mirror/$1/repo" "/work/.mirror/$1"; do
    if has_head "$d"; then
      (cd "$d" && pwd)
      return 0
    fi
    [ -n "${2:-}" ] && break
  done
  return 1
}

# submodule_commit MIRROR PATH: the commit a gitlink at PATH in the mirror's HEAD points to.
submodule_commit() {
  mgit "$1" ls-tree HEAD "$2" | awk '$2 == "commit" { print $3 }'
}

FLA_MIRROR=$(find_mirror fla-org+flash-linear-attention "${1:-}") || {
  echo "make_peers.sh: no git mirror of fla-org/flash-linear-attention found (pass its git directory)" >&2
  exit 1
}
cd "$(dirname "$0")/../.."
mkdir -p .peers
grep -qx '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >>.git/info/exclude

# ------------------------------------------------------------------------------------------------ fla
D=.peers/fla-src
rm -rf "$D"
mkdir -p "$D"
COMMIT=$(mgit "$FLA_MIRROR" rev-parse HEAD)
mgit "$FLA_MIRROR" archive --format=tar "$COMMIT" fla LICENSE | tar -x -C "$D"
if [ ! -f "$D/fla/ops/kda/chunk.py" ] || [ ! -f "$D/fla/ops/kda/fused_recurrent.py" ]; then
  echo "make_peers.sh: $COMMIT has no fla/ops/kda/{chunk,fused_recurrent}.py" >&2
  exit 1
fi
echo "$COMMIT" >"$D/COMMIT"
echo "made $D at fla commit $COMMIT"

# ------------------------------------------------------------------------------------------------ CUTLASS
missing=()
CUTLASS_MIRROR=$(find_mirror NVIDIA+cutlass "${CUTLASS_MIRROR:-}") || CUTLASS_MIRROR=
rm -rf .peers/cutlass
mkdir -p .peers/cutlass

# pack_cutlass PEER_DIR PINNED: packs CUTLASS's headers at PINNED (or the newest v4.x tag when the mirror lacks
# it) into .peers/cutlass/<commit>.tar.gz once, and records both commits in PEER_DIR.
pack_cutlass() {
  local dir=$1 pinned=$2 used tag
  echo "$pinned" >"$dir/CUTLASS_PINNED"
  if mgit "$CUTLASS_MIRROR" cat-file -e "$pinned^{commit}" 2>/dev/null; then
    used=$pinned
  else
    tag=$(mgit "$CUTLASS_MIRROR" tag -l 'v4.*' | sort -V | tail -1)
    [ -n "$tag" ] || return 1
    used=$(mgit "$CUTLASS_MIRROR" rev-parse "$tag^{commit}")
    echo "make_peers.sh: the CUTLASS mirror lacks $pinned (pinned by $dir); using $tag ($used) instead" >&2
  fi
  echo "$used" >"$dir/CUTLASS_COMMIT"
  local pack=".peers/cutlass/$used.tar.gz" paths=(include tools/util/include LICENSE.txt)
  if [ ! -f "$pack" ]; then
    # git archive reports blobs this partial mirror lacks elsewhere in the tree (images) even when it exports only
    # these paths; its stderr is dropped and the packed file count is checked against the tree instead.
    mgit "$CUTLASS_MIRROR" archive --format=tar "$used" "${paths[@]}" 2>/dev/null | gzip -9 -n >"$pack"
    if [ "$(tar -tzf "$pack" | grep -cv '/$')" != "$(mgit "$CUTLASS_MIRROR" ls-tree -r "$used" "${paths[@]}" | wc -l)" ]; then
      echo "make_peers.sh: CUTLASS $used: the packed headers do not match the tree" >&2
      rm -f "$pack"
      return 1
    fi
  fi
  # (git describe on this mirror reports missing objects of the partial copy, hence the tag lists)
  tag=$(mgit "$CUTLASS_MIRROR" tag --points-at "$used" | head -1)
  [ -n "$tag" ] || tag="after $(mgit "$CUTLASS_MIRROR" tag --merged "$used" 'v*' | sort -V | tail -1)"
  echo "  CUTLASS for $dir: $used ($tag)"
}

# ------------------------------------------------------------------------------------------------ FlashMLA
make_flashmla() {
  local mirror d=.peers/flashmla-src commit
  mirror=$(find_mirror deepseek-ai+FlashMLA "${FLASHMLA_MIRROR:-}") || {
    echo "make_peers.sh: no git mirror of deepseek-ai/FlashMLA found (FLASHMLA_MIRROR)" >&2
    return 1
  }
  rm -rf "$d"
  mkdir -p "$d"
  commit=$(mgit "$mirror" rev-parse HEAD)
  mgit "$mirror" archive --format=tar "$commit" setup.py LICENSE csrc flash_mla tests/quant.py | tar -x -C "$d"
  rmdir "$d/csrc/cutlass" 2>/dev/null || true  # the submodule's empty placeholder; the build links CUTLASS there
  local f
  for f in setup.py csrc/api/sparse_decode.h csrc/api/sparse_fwd.h flash_mla/flash_mla_interface.py tests/quant.py; do
    if [ ! -f "$d/$f" ]; then
      echo "make_peers.sh: FlashMLA $commit has no $f" >&2
      return 1
    fi
  done
  echo "$commit" >"$d/COMMIT"
  echo "made $d at FlashMLA commit $commit"
  pack_cutlass "$d" "$(submodule_commit "$mirror" csrc/cutlass)"
}

# ------------------------------------------------------------------------------------------------ DeepGEMM
make_deepgemm() {
  local mirror fmt_mirror d=.peers/deepgemm-src commit fmt_commit
  mirror=$(find_mirror deepseek-ai+DeepGEMM "${DEEPGEMM_MIRROR:-}") || {
    echo "make_peers.sh: no git mirror of deepseek-ai/DeepGEMM found (DEEPGEMM_MIRROR)" >&2
    return 1
  }
  fmt_mirror=$(find_mirror fmtlib+fmt "${FMT_MIRROR:-}") || {
    echo "make_peers.sh: no git mirror of fmtlib/fmt found (FMT_MIRROR); DeepGEMM's C++ module needs it" >&2
    return 1
  }
  rm -rf "$d"
  mkdir -p "$d/third-party/fmt"
  commit=$(mgit "$mirror" rev-parse HEAD)
  mgit "$mirror" archive --format=tar "$commit" setup.py LICENSE csrc deep_gemm | tar -x -C "$d"
  fmt_commit=$(submodule_commit "$mirror" third-party/fmt)
  if ! mgit "$fmt_mirror" cat-file -e "$fmt_commit^{commit}" 2>/dev/null; then
    echo "make_peers.sh: the fmt mirror lacks $fmt_commit (pinned by DeepGEMM $commit)" >&2
    return 1
  fi
  mgit "$fmt_mirror" archive --format=tar "$fmt_commit" include LICENSE | tar -x -C "$d/third-party/fmt"
  local f
  for f in csrc/python_api.cpp csrc/apis/attention.hpp deep_gemm/__init__.py \
    deep_gemm/include/deep_gemm/impls/sm90_fp8_paged_mqa_logits.cuh \
    deep_gemm/include/deep_gemm/impls/sm90_fp8_mqa_logits.cuh third-party/fmt/include/fmt/format.h; do
    if [ ! -f "$d/$f" ]; then
      echo "make_peers.sh: DeepGEMM $commit has no $f" >&2
      return 1
    fi
  done
  echo "$commit" >"$d/COMMIT"
  echo "$fmt_commit" >"$d/FMT_COMMIT"
  echo "made $d at DeepGEMM commit $commit (fmt $fmt_commit)"
  pack_cutlass "$d" "$(submodule_commit "$mirror" third-party/cutlass)"
}

if [ -z "$CUTLASS_MIRROR" ]; then
  echo "make_peers.sh: no git mirror of NVIDIA/cutlass found (CUTLASS_MIRROR); FlashMLA and DeepGEMM left out" >&2
  rm -rf .peers/cutlass .peers/flashmla-src .peers/deepgemm-src
  missing+=(flashmla deepgemm)
else
  make_flashmla || { rm -rf .peers/flashmla-src; missing+=(flashmla); }
  make_deepgemm || { rm -rf .peers/deepgemm-src; missing+=(deepgemm); }
fi

cat >.peers/README <<'TXT'
Made by bench/gpu/make_peers.sh from local git mirrors: the source of the peer libraries, carried to the GPU
machine. fla-src/ (flash-linear-attention's `fla` package) for bench/gpu/peers_kda.py; flashmla-src/ (FlashMLA),
deepgemm-src/ (DeepGEMM) and cutlass/<commit>.tar.gz (CUTLASS headers at the commits they pin) for
bench/gpu/build_peers_h200.sh and bench/gpu/peers_dsa.py. Each peer folder names its commits (COMMIT, ...).
Git-ignored; not part of the repository.
TXT

BUDGET=$((55 * 1024 * 1024))
PEERS_BYTES=$(du -sb .peers | cut -f1)
DEVDEPS_BYTES=$( [ -d .devdeps ] && du -sb .devdeps | cut -f1 || echo 0)
echo "sizes:"
du -sh .peers/* | sed 's/^/  /'
echo "  .peers in all: $(du -sh .peers | cut -f1) ($PEERS_BYTES bytes); .devdeps: $DEVDEPS_BYTES bytes"
if [ $((PEERS_BYTES + DEVDEPS_BYTES)) -gt "$BUDGET" ]; then
  echo "make_peers.sh: .peers + .devdeps is $((PEERS_BYTES + DEVDEPS_BYTES)) bytes, over the 55 MB budget" >&2
  exit 1
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "make_peers.sh: left out: ${missing[*]}" >&2
  exit 1
fi
