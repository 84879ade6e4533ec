#!/usr/bin/env bash
# Makes .peers/fla-src/ for bench/gpu/peers_kda.py: the `fla` package (pure Python + Triton) and the LICENSE of a
# local git mirror of github.com/fla-org/flash-linear-attention, at the mirror's HEAD, with that commit in
# .peers/fla-src/COMMIT. The H200 device machine has torch and triton but no network, so the source travels with
# the device call: run this once here, then carry `.peers`. The folder is git-ignored through .git/info/exclude and
# never committed; fla's code is run as a peer, never copied into Kestrel.
# Usage: bench/gpu/make_peers.sh [mirror-git-dir]   (default: the fla mirror under /work/.mirror)
set -euo pipefail
MIRROR=${1:-}
if [ -z "$MIRROR" ]; then
  for d in /work/.mirror/fla-org+flash-linear-attention/repo /work/.mirror/fla-org+flash-linear-attention; do
    if git --git-dir="$d" rev-parse --verify -q HEAD >/dev/null 2>&1; then
      MIRROR=$d
      break
    fi
  done
fi
if [ -z "$MIRROR" ] || ! git --git-dir="$MIRROR" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  echo "make_peers.sh: no git mirror of fla-org/flash-linear-attention found (pass its git directory)" >&2
  exit 1
fi
MIRROR=$(cd "$MIRROR" && pwd)
cd "$(dirname "$0")/../.."
D=.peers/fla-src
rm -rf "$D"
mkdir -p "$D"
COMMIT=$(git --git-dir="$MIRROR" rev-parse HEAD)
git --git-dir="$MIRROR" archive --format=tar "$COMMIT" fla LICENSE | tar -x -C "$D"
if [ ! -f "$D/fla/ops/kda/chunk.py" ] || [ ! -f "$D/fla/ops/kda/fused_recurrent.py" ]; then
  echo "make_peers.sh: $COMMIT has no fla/ops/kda/{chunk,fused_recurrent}.py" >&2
  exit 1
fi
echo "$COMMIT" >"$D/COMMIT"
grep -qx '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >>.git/info/exclude

cat >.peers/README <<'TXT'
Made by bench/gpu/make_peers.sh: the source of peer libraries (fla-src/: flash-linear-attention's
`fla` package, its LICENSE and COMMIT), carried to the GPU machine for bench/gpu/peers_kda.py.
Git-ignored; not part of the repository.
TXT
BYTES=$(du -sb .peers | cut -f1)
if [ "$BYTES" -gt $((20 * 1024 * 1024)) ]; then
  echo "make_peers.sh: .peers is $BYTES bytes, over the 20 MB budget for carried folders" >&2
  exit 1
fi
echo "made $D at fla commit $COMMIT (.peers: $(du -sh .peers | cut -f1), $BYTES bytes)"
