#!/usr/bin/env bash
# Makes .devdeps/: what the top-level project needs to build on the GPU machine, which has nvcc, cmake, ninja and g++
# but neither Debian's -dev packages nor a network. Copied from this machine's Debian packages (installed by
# tools/setup.sh): the headers of nlohmann-json, fmt (header-only), CLI11, the part of Boost that Kestrel includes
# (Beast and Asio: the headers the compiler opens for src/, found with -MM), Oniguruma and xxHash; libxxhash.a and
# libonig.so.5; the googletest sources (built there by run_h200.sh); CMake package files for the header-only
# packages; and the King James text make-model trains its tokenizer on. Run once here, then carry `.devdeps` with
# the device call. The folder is git-ignored through .git/info/exclude, never committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.devdeps
rm -rf "$D"
mkdir -p "$D/include" "$D/lib" "$D/cmake"
cp -r /usr/include/fmt /usr/include/nlohmann /usr/include/CLI "$D/include/"
cp /usr/include/xxhash.h /usr/include/oniguruma.h "$D/include/"
cp /usr/lib/x86_64-linux-gnu/libxxhash.a "$D/lib/"
cp -L /usr/lib/x86_64-linux-gnu/libonig.so.5 "$D/lib/"
ln -sf libonig.so.5 "$D/lib/libonig.so"

# Boost: only the headers the project's sources open.
mapfile -t sources < <(ls src/*/*.cpp src/kernels/cpu/*.cpp tests/*/*.cpp bench/*/*.cpp 2>/dev/null | grep -v '/cuda/')
for f in "${sources[@]}"; do
  g++ -std=c++20 -M -MT x -Isrc -Itests "$f" 2>/dev/null || true
done | tr ' \\' '\n\n' | grep '^/usr/include/boost/' | sort -u >"$D/boost-headers.txt"
while read -r h; do
  mkdir -p "$D/include/$(dirname "${h#/usr/include/}")"
  cp "$h" "$D/include/${h#/usr/include/}"
done <"$D/boost-headers.txt"
cp /usr/include/boost/version.hpp "$D/include/boost/"  # what FindBoost reads

cp -r /usr/src/googletest "$D/googletest"
rm -rf "$D/googletest/googletest/docs" "$D/googletest/googletest/test" "$D/googletest/googletest/samples" \
  "$D/googletest/googlemock/test"
bible Gen1:1-Rev22:21 >"$D/kjv.txt"

# CMake package files of the header-only packages (find_package(fmt | nlohmann_json | CLI11) with CMAKE_PREFIX_PATH
# pointing at .devdeps/cmake).
package() {
  local name=$1 target=$2 version=$3 defs=${4:-}
  mkdir -p "$D/cmake/$name"
  cat >"$D/cmake/$name/$name-config.cmake" <<CMAKE
if(NOT TARGET $target)
  add_library($target INTERFACE IMPORTED)
  set_target_properties($target PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "\${CMAKE_CURRENT_LIST_DIR}/../../include"
                                           INTERFACE_COMPILE_DEFINITIONS "$defs")
endif()
CMAKE
  cat >"$D/cmake/$name/$name-config-version.cmake" <<CMAKE
set(PACKAGE_VERSION $version)
set(PACKAGE_VERSION_COMPATIBLE TRUE)
CMAKE
}
package fmt fmt::fmt 9.1.0 FMT_HEADER_ONLY=1
package nlohmann_json nlohmann_json::nlohmann_json 3.11.2
package CLI11 CLI11::CLI11 2.3.2
grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >>.git/info/exclude
echo "made $D ($(du -sh "$D" | cut -f1); $(wc -l <"$D/boost-headers.txt") Boost headers)"
