#!/usr/bin/env bash
# Cross-build the native runtime (mtp-runner, libmtp_edge.so, mtp-native-tests) for aarch64 Linux
# against the aarch64 executorch wheel, and install it as a self-contained folder:
#   OUT/mtp-runner, OUT/mtp-native-tests, OUT/lib/*.so
# (default OUT: runtime/native/build-arm64/device). Run the programs here with
#   qemu-aarch64 -L /usr/aarch64-linux-gnu OUT/mtp-runner --bundle DIR ...
# The wheel is downloaded once with pip into the cache (MTP_ARM64_CACHE, default
# ~/.cache/mtp-edge/arm64). Anything missing is said in one "error: ..." line (exit 2).
#
# Usage: build-arm64.sh [--out DIR] [--build-dir DIR] [--jobs N]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source_dir="$(dirname "$here")"
build_dir="$source_dir/build-arm64/cmake"
out_dir="$source_dir/build-arm64/device"
jobs="$(nproc 2>/dev/null || echo 1)"
cache="${MTP_ARM64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mtp-edge/arm64}"
python="${MTP_PYTHON:-python3}"
install_hint="apt-get install -y g++-aarch64-linux-gnu qemu-user"

fail() {
  echo "error: $*" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out_dir="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) fail "unknown option $1 (see --help)" ;;
  esac
done

command -v cmake >/dev/null || fail "cmake is not installed: apt-get install -y cmake"
command -v aarch64-linux-gnu-g++ >/dev/null \
  || fail "g++-aarch64-linux-gnu is not installed: $install_hint"
command -v "$python" >/dev/null || fail "$python is not installed (pip downloads the wheel)"

# The executorch version the exporter uses (its .pte files must match the runtime), else the pin.
version="${MTP_EXECUTORCH_VERSION:-$("$python" -c \
  'import importlib.metadata as m; print(m.version("executorch"))' 2>/dev/null || echo 1.5.1)}"
root="$cache/executorch-$version"
if [ ! -f "$root/.unpacked" ]; then
  mkdir -p "$cache"
  wheel="$(ls "$cache"/executorch-"$version"-*manylinux*aarch64.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$wheel" ]; then
    echo "[arm64] pip download executorch==$version (manylinux_2_28_aarch64) into $cache" >&2
    log="$cache/pip-download.log"
    "$python" -m pip download --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
      --python-version 3.11 "executorch==$version" -d "$cache" >"$log" 2>&1 \
      || fail "could not download the aarch64 executorch==$version wheel: $(tail -n1 "$log")"
    wheel="$(ls "$cache"/executorch-"$version"-*manylinux*aarch64.whl | head -n1)"
  fi
  # Only what a C++ build needs: headers, shared libraries, the CMake package config.
  rm -rf "$root"
  "$python" - "$wheel" "$root" <<'PY'
import sys
import zipfile

wheel, root = sys.argv[1:]
keep = ("executorch/include/", "executorch/lib/", "executorch/share/")
with zipfile.ZipFile(wheel) as z:
    z.extractall(root, [n for n in z.namelist() if n.startswith(keep)])
PY
  chmod 755 "$root"/executorch/lib/*.so*
  touch "$root/.unpacked"
fi

# nlohmann/json is headers only: the pip package's include directory (never the host's
# /usr/include, which holds the host's C library headers too), else a directory holding only a
# link to Debian's nlohmann/, else the pip package downloaded into the cache.
nlohmann="$("$python" -c 'import importlib.util as u, pathlib as p
s = u.find_spec("nlohmann_json")
d = p.Path(s.submodule_search_locations[0]) / "include" if s else None
print(d if d and (d / "nlohmann" / "json.hpp").is_file() else "")' 2>/dev/null || true)"
if [ -z "$nlohmann" ] && [ -f /usr/include/nlohmann/json.hpp ]; then
  nlohmann="$cache/nlohmann-include"
  mkdir -p "$nlohmann" && ln -sfn /usr/include/nlohmann "$nlohmann/nlohmann"
fi
if [ -z "$nlohmann" ]; then
  "$python" -m pip download --no-deps nlohmann_json -d "$cache/nlohmann" >/dev/null 2>&1 \
    || fail "the build needs nlohmann/json: pip install nlohmann_json"
  "$python" - "$cache/nlohmann" <<'PY'
import pathlib
import sys
import zipfile

d = pathlib.Path(sys.argv[1])
zipfile.ZipFile(next(d.glob("nlohmann_json-*.whl"))).extractall(d / "unpacked")
PY
  nlohmann="$(dirname "$(dirname "$(find "$cache/nlohmann/unpacked" -path '*nlohmann/json.hpp' | head -n1)")")"
fi

# Configured every time (seconds), so that the cache's paths follow MTP_ARM64_CACHE; a build
# directory a failed configure left half-made is started afresh.
[ -f "$build_dir/Makefile" ] || rm -rf "$build_dir"
cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$here/aarch64-linux-gnu.cmake" \
  -DEXECUTORCH_ROOT="$root/executorch" -DMTP_NLOHMANN_INCLUDE="$nlohmann" >&2 \
  || { rm -rf "$build_dir"; fail "configuring the aarch64 build failed (output above)"; }
cmake --build "$build_dir" -j "$jobs" >&2 || fail "the aarch64 build failed (output above)"
rm -rf "$out_dir"
cmake --install "$build_dir" --prefix "$out_dir" >/dev/null
echo "$out_dir"
