#!/usr/bin/env bash
# Build llama.cpp's server and take its GGUF converter, once, from the source distribution of llama-cpp-python
# on PyPI (it carries the llama.cpp tree in vendor/llama.cpp, with the EAGLE-3 drafter support): nothing else is
# fetched and nothing is vendored into this repository. The build lives in the user cache, outside the clone;
# CPU native by default, CUDA where nvidia-smi lists a GPU (LLAMACPP_CUDA=0/1 overrides). A stamp file holding
# the pin and the options makes a second run instant; a changed pin rebuilds from scratch.
set -euo pipefail

LLAMACPP_PY_VERSION=0.3.36
# the Llama converter imports sentencepiece even for a BPE tokenizer; installed into the build's own folder
SENTENCEPIECE_SPEC=sentencepiece==0.2.3
ROOT="${EAGLE3_HF_LLAMACPP_DIR:-$HOME/.cache/eagle3_hf/llamacpp/$LLAMACPP_PY_VERSION}"
PYTHON="${PYTHON:-python3}"
JOBS="${LLAMACPP_JOBS:-$(nproc 2>/dev/null || echo 2)}"
# the whole source distribution stays unpacked: its .git/modules records the llama.cpp commit the build reports
TREE="$ROOT/llama_cpp_python-$LLAMACPP_PY_VERSION/vendor/llama.cpp"
BUILD="$TREE/build"
STAMP="$ROOT/.eagle3_hf_llamacpp"

if [[ -z "${LLAMACPP_CUDA:-}" ]]; then
    LLAMACPP_CUDA=0
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
        LLAMACPP_CUDA=1
    fi
fi
# native, less AMX on x86-64: ggml's AMX kernels (-march=native turns them on where the CPU lists amx_int8) died of an
# illegal instruction (tilezero) on the first forward of a 2-core Xeon with AMX, 0.3.36; the -mno-amx flags win over
# -march=native whatever their order (gcc and clang). The CPU's other extensions (AVX-512 among them) stay on.
NATIVE_FLAGS=""
[[ "$HOSTTYPE" == "x86_64" ]] && NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
WANT="llama-cpp-python==$LLAMACPP_PY_VERSION cuda=$LLAMACPP_CUDA $SENTENCEPIECE_SPEC cflags=$NATIVE_FLAGS"

# the converter's one import our venv lacks, for the Python that runs it (CONVERTER_PYTHON: the venv's, from make)
converter_deps() {
    "${CONVERTER_PYTHON:-$PYTHON}" -m pip install -q --no-deps --upgrade --target "$ROOT/python" "$SENTENCEPIECE_SPEC" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# the server stays in the cache: this line puts it on PATH; eagle3-hf finds it there without it
path_line() {
    echo "llama.cpp: $BUILD/bin/llama-server; converter: $TREE/convert_hf_to_gguf.py;" \
        "to run \`llama-server\` by name: export PATH=\"\$PATH:$BUILD/bin\""
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$BUILD/bin/llama-server" ]]; then
    echo "llama.cpp (llama-cpp-python==$LLAMACPP_PY_VERSION) already built in $ROOT"
    path_line
    exit 0
fi

for tool in cmake c++; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "error: make llamacpp needs cmake and a C++ compiler; \`$tool\` is not on PATH (e.g. apt-get install cmake g++)" >&2
        exit 1
    fi
done
if ((LLAMACPP_CUDA)) && ! command -v nvcc >/dev/null 2>&1; then
    echo "error: nvidia-smi lists a GPU but nvcc (the CUDA toolkit) is not on PATH; install it or set LLAMACPP_CUDA=0" >&2
    exit 1
fi

if [[ -e "$ROOT" && ! -f "$STAMP" && -n "$(ls -A "$ROOT")" ]]; then
    echo "error: $ROOT exists and holds no llama.cpp build of ours; refusing to replace it (set EAGLE3_HF_LLAMACPP_DIR)" >&2
    exit 1
fi
start=$(date +%s)
rm -rf "$ROOT"
mkdir -p "$ROOT"
# pip's own chatter about index locations this machine lacks is dropped; its errors stay
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
quiet "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMACPP_PY_VERSION" -d "$ROOT/sdist"
SDIST="$ROOT/sdist/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz"
tar -xzf "$SDIST" -C "$ROOT"
rm -rf "$ROOT/sdist"

# no HTTPS (models are local files) and no web UI: its prebuilt assets would be downloaded from the Hub at build time
CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON)
[[ -n "$NATIVE_FLAGS" ]] && CMAKE_ARGS+=("-DCMAKE_C_FLAGS=$NATIVE_FLAGS" "-DCMAKE_CXX_FLAGS=$NATIVE_FLAGS")
((LLAMACPP_CUDA)) && CMAKE_ARGS+=(-DGGML_CUDA=ON)
echo "building llama-server (cuda=$LLAMACPP_CUDA, $JOBS jobs) in $BUILD"
cmake -S "$TREE" -B "$BUILD" "${CMAKE_ARGS[@]}" > "$ROOT/cmake.log" 2>&1 || { tail -20 "$ROOT/cmake.log" >&2; exit 1; }
cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-server > "$ROOT/build.log" 2>&1 \
    || { tail -30 "$ROOT/build.log" >&2; exit 1; }
"$BUILD/bin/llama-server" --version 2>&1 | grep -E "^(version|built with)" || true
converter_deps
echo "$WANT" > "$STAMP"
echo "llama.cpp built in $ROOT in $(( $(date +%s) - start )) s"
path_line
