#!/usr/bin/env bash
# Installs the peers that benchmarks/compare_peers.py measures shoal against, into .peers/
# (ignored by git), apart from shoal's own .venv. Nothing in `make test` needs them.
#   .peers/venv            torch 2.13.0 (CPU), transformers[serving] (for `transformers serve`),
#                          llama-cpp-python[server] built from source
#   .peers/llama-server    llama.cpp's own server, built with cmake from the llama.cpp sources
#                          vendored in the llama-cpp-python sdist (the same llama.cpp revision)
#   .peers/llama-server-avx2  the same, built for AVX2 only (no native tuning, no AVX-512)
#   .peers/llama-server-baseline  the same, built for the x86-64 baseline (SSE2)
#   .peers/llama-quantize  llama.cpp's quantizer from the first build (benchmarks/gguf_formats.py makes its files
#                          with it and with the sources' convert_hf_to_gguf.py)
# Both builds compile llama.cpp; on a 2-core machine each takes several minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
LCP_VERSION=${LCP_VERSION:-0.3.36}
PY=${PY:-python3}
PEERS=.peers
mkdir -p "$PEERS"
JOBS=$(nproc)

if [ ! -x "$PEERS/venv/bin/python" ]; then
    $PY -m venv "$PEERS/venv"
fi
VPY="$PEERS/venv/bin/python"
$VPY -m pip install -q --upgrade pip
# torch first: the CPU build on this machine's disk (a bare "torch" pulls a CUDA build).
$VPY -m pip install -q torch==2.13.0
TRANSFORMERS_VERSION=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo "")
$VPY -m pip install -q "transformers[serving]${TRANSFORMERS_VERSION:+==$TRANSFORMERS_VERSION}" accelerate gguf sentencepiece protobuf

# llama.cpp's own llama-server, from the sources vendored in the llama-cpp-python sdist, built twice:
#   llama-server       tuned for this CPU (GGML_NATIVE), as a user building it here would;
#   llama-server-avx2  native tuning, AVX-512 and AVX-VNNI off: the AVX2 + FMA code an AVX2-only laptop
#                      runs, the fair peer for shoal forced onto its AVX2 path (SHOAL_CPU_ISA=avx2);
#   llama-server-baseline  every x86 extension off (SSE2, the x86-64 baseline): the peer for SHOAL_CPU_ISA=baseline.
SRC="$PEERS/src"
LLAMA_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)
build_llama_server() {  # $1: the binary's name in .peers, then cmake flags
    local name=$1; shift
    [ -x "$PEERS/$name" ] && { [ "$name" != llama-server ] || [ -x "$PEERS/llama-quantize" ]; } && return 0
    if [ ! -d "$SRC" ] || ! ls "$SRC"/llama_cpp_python-*/vendor/llama.cpp >/dev/null 2>&1; then
        rm -rf "$SRC" && mkdir -p "$SRC"
        $VPY -m pip download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$LCP_VERSION"
        tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
    fi
    local llama build="$SRC/build-$name"
    llama="$(echo "$SRC"/llama_cpp_python-*/vendor/llama.cpp)"
    cmake -S "$llama" -B "$build" "${LLAMA_FLAGS[@]}" "$@"
    cmake --build "$build" --target llama-server -j "$JOBS"
    cp "$build/bin/llama-server" "$PEERS/$name"
    if [ "$name" = llama-server ]; then  # llama.cpp's quantizer, for benchmarks/gguf_formats.py's files
        cmake --build "$build" --target llama-quantize -j "$JOBS"
        cp "$build/bin/llama-quantize" "$PEERS/llama-quantize"
    fi
}
build_llama_server llama-server -DGGML_NATIVE=ON
build_llama_server llama-server-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
build_llama_server llama-server-baseline -DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF \
    -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
    -DGGML_AVX512_BF16=OFF

# llama-cpp-python's server (one request at a time); pip compiles the same llama.cpp.
if ! $VPY -c 'import llama_cpp.server' 2>/dev/null; then
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
        $VPY -m pip install -q "llama-cpp-python[server]==$LCP_VERSION"
fi
echo "peers installed in $PEERS: $("$PEERS/llama-server" --version 2>&1 | head -1) (native, AVX2-only and baseline builds); llama-cpp-python $LCP_VERSION"
