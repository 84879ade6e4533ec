#!/usr/bin/env bash
# Makes .devdeps/ for bench/gpu/run_h200.sh: fmt as a header-only package, the googletest sources, nlohmann-json,
# xxHash and Oniguruma, copied from this machine's Debian packages (libfmt-dev, googletest, nlohmann-json3-dev,
# libxxhash-dev, libonig-dev), so that a GPU machine without them or a network can
# configure bench/gpu/CMakeLists.txt. Run once here, then carry `.devdeps` with the device call. The folder is
# git-ignored through .git/info/exclude, never committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.devdeps
rm -rf "$D"
mkdir -p "$D/include" "$D/fmt"
cp -r /usr/include/fmt /usr/include/nlohmann "$D/include/"
# The engine's own dependencies, for the GPU engine's tests (tests/gpu): xxHash (static library and header) and
# Oniguruma (header and shared library; the GPU machine's loader finds it through the rpath CMake sets).
mkdir -p "$D/lib"
cp /usr/include/xxhash.h /usr/include/oniguruma.h "$D/include/"
cp /usr/lib/x86_64-linux-gnu/libxxhash.a "$D/lib/"
cp -L /usr/lib/x86_64-linux-gnu/libonig.so.5 "$D/lib/"
ln -sf libonig.so.5 "$D/lib/libonig.so"
# The tokenizer training text of make_model (bible-kjv), as a file: run_h200.sh sets KESTREL_KJV_TEXT to it.
bible Gen1:1-Rev22:21 >"$D/kjv.txt"
cp -r /usr/src/googletest "$D/googletest"
rm -rf "$D/googletest/googletest/docs" "$D/googletest/googletest/test" "$D/googletest/googletest/samples" \
  "$D/googletest/googlemock/test"
grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >>.git/info/exclude

cat >"$D/README" <<'TXT'
Made by bench/gpu/make_devdeps.sh: fmt (header-only) and the googletest sources, carried to
the GPU machine for bench/gpu/run_h200.sh. Git-ignored; not part of the repository.
TXT
cat >"$D/fmt/fmt-config.cmake" <<'CMAKE'
if(NOT TARGET fmt::fmt)
  add_library(fmt::fmt INTERFACE IMPORTED)
  set_target_properties(fmt::fmt PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_LIST_DIR}/../include"
                                             INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
endif()
CMAKE
echo "made $D ($(du -sh "$D" | cut -f1))"
