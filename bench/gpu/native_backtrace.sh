#!/usr/bin/env bash
# Runs a command with bench/gpu/segv_backtrace.c preloaded (built here with cc), for a native backtrace of a crash
# on a machine without gdb, then resolves the frames in the modules whose path matches a pattern with addr2line
# (function, inlined callers, file:line; needs the module built with -g).
# Usage: bench/gpu/native_backtrace.sh LOG MODULE_REGEX COMMAND [ARGS...]
#   e.g. bench/gpu/native_backtrace.sh out/segv.log 'deep_gemm/_C' python3 bench/gpu/peers_dsa.py --sections ...
# Writes the command's stdout and stderr, then the resolved frames ("resolved #N ..."), to LOG; exits with the
# command's status (139 for a segfault), or 3 when the library cannot be built.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: native_backtrace.sh LOG MODULE_REGEX COMMAND [ARGS...]" >&2; exit 2; }
LOG=$1
PATTERN=$2
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
LIB=$(mktemp -d)/segv_backtrace.so
trap 'rm -rf "$(dirname "$LIB")"' EXIT
if ! cc -O1 -g -fPIC -shared -o "$LIB" "$HERE/segv_backtrace.c" -ldl >"$LOG" 2>&1; then
  echo "native_backtrace: cc failed (see $LOG)"
  exit 3
fi
LD_PRELOAD="$LIB${LD_PRELOAD:+:$LD_PRELOAD}" "$@" >>"$LOG" 2>&1
rc=$?
if command -v addr2line >/dev/null 2>&1; then
  grep -E '^segv_backtrace: #[0-9]+ ' "$LOG" | while read -r _ frame module offset _; do
    [[ "$module" =~ $PATTERN ]] || continue
    echo "resolved $frame $module $offset:"
    addr2line -f -C -i -e "$module" "${offset#+}" | sed 's/^/    /'
  done >>"$LOG" 2>&1
else
  echo "native_backtrace: no addr2line on this machine" >>"$LOG"
fi
exit "$rc"
