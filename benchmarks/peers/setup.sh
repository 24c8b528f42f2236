#!/usr/bin/env bash
# Installs the peers that benchmarks/compare_peers.py measures shoal against, into .peers/
# (ignored by git), apart from shoal's own .venv. Nothing in `make test` needs them.
#   .peers/venv            torch 2.13.0 (CPU), transformers[serving] (for `transformers serve`),
#                          llama-cpp-python[server] built from source
#   .peers/llama-server    llama.cpp's own server, built with cmake from the llama.cpp sources
#                          vendored in the llama-cpp-python sdist (the same llama.cpp revision)
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

# llama.cpp's own llama-server, from the sources vendored in the llama-cpp-python sdist.
if [ ! -x "$PEERS/llama-server" ]; then
    SRC="$PEERS/src"
    rm -rf "$SRC" && mkdir -p "$SRC"
    $VPY -m pip download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$LCP_VERSION"
    tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
    LLAMA="$(echo "$SRC"/llama_cpp_python-*/vendor/llama.cpp)"
    cmake -S "$LLAMA" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    cmake --build "$SRC/build" --target llama-server -j "$JOBS"
    cp "$SRC/build/bin/llama-server" "$PEERS/llama-server"
fi

# llama-cpp-python's server (one request at a time); pip compiles the same llama.cpp.
if ! $VPY -c 'import llama_cpp.server' 2>/dev/null; then
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
        $VPY -m pip install -q "llama-cpp-python[server]==$LCP_VERSION"
fi
echo "peers installed in $PEERS: $("$PEERS/llama-server" --version 2>&1 | head -1); llama-cpp-python $LCP_VERSION"
