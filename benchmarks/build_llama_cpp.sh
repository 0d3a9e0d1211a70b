#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, mtp-bench's llama.cpp peer, from the llama.cpp source that the
# llama-cpp-python source package on PyPI carries (no model hub or git host needed), and prints
# the directory to give mtp-bench --llama-cpp. Running it again rebuilds in place.
#
#   benchmarks/build_llama_cpp.sh [DIR]      (default: build/llama.cpp; needs cmake and g++)
#   mtp-bench --bundle bundles/X --llama-cpp DIR [--gguf MODEL.gguf]
#
# With MTP_EDGE_CPU_CLASS=avx2 in the environment (as for mtp-edge's own commands, see
# benchmarks/README.md "The AVX2 class on a CPU that has more") llama.cpp is built for AVX2 + FMA
# + F16C without AVX-512 or VNNI, the kernels such a CPU runs; otherwise for this CPU.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
out="$(realpath -m "${1:-build/llama.cpp}")"
src="$out/source"
if [ ! -f "$src/CMakeLists.txt" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  echo "[llama.cpp] fetching llama-cpp-python $version's source from PyPI" >&2
  pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$version" -d "$work" >&2
  tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
  mkdir -p "$out"
  mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$src"
fi
case "${MTP_EDGE_CPU_CLASS:-}" in
  "") isa=(-DGGML_NATIVE=ON) ;;
  avx2) isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
             -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF
             -DGGML_AVX_VNNI=OFF) ;;
  *) echo "build_llama_cpp.sh: MTP_EDGE_CPU_CLASS=${MTP_EDGE_CPU_CLASS} is not a class this script builds for; use avx2 or leave it unset" >&2; exit 2 ;;
esac
echo "[llama.cpp] configuring in $out/build (${isa[*]})" >&2
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF >&2
echo "[llama.cpp] building llama-bench (a few minutes)" >&2
cmake --build "$out/build" --target llama-bench -j "$(nproc)" >&2
test -x "$out/build/bin/llama-bench"
echo "$out"
