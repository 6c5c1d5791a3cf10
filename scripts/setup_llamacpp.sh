#!/usr/bin/env bash
# llama.cpp as a benchmark peer (bench/decode.py --peers llamacpp): llama-cpp-python built from source for this
# CPU (-march=native through GGML_NATIVE) in its own virtual environment, and the package's source kept for its
# GGUF converter (vendor/llama.cpp/convert_hf_to_gguf.py with gguf-py; sentencepiece beside them). Idempotent; about 10-20 minutes on 2 cores.
#   bash scripts/setup_llamacpp.sh
set -euo pipefail
VERSION=0.3.36
HOME_DIR="${SHARDLM_HOME:-$HOME/.cache/shardlm}/tools/llamacpp"
VENV="$HOME_DIR/venv"
SRC="$HOME_DIR/src"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null \
    && [ -f "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" ] && [ -d "$HOME_DIR/convert-deps" ]; then
  echo "llama-cpp-python $VERSION is installed in $VENV"
  exit 0
fi
command -v cmake >/dev/null || { echo "cmake is missing: install it (apt-get install cmake) and run this again" >&2; exit 1; }
command -v c++ >/dev/null || { echo "no C++ compiler: install g++ and run this again" >&2; exit 1; }

mkdir -p "$SRC"
echo "== virtual environment $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "numpy<3"

echo "== source of llama-cpp-python $VERSION into $SRC"
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
  "$VENV/bin/pip" download --quiet --no-binary :all: --no-deps --dest "$SRC" "llama-cpp-python==$VERSION"
  tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi

echo "== building (GGML_NATIVE: this CPU's instructions; CPU only)"
start=$(date +%s)
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" FORCE_CMAKE=1 \
  nice -n 10 "$VENV/bin/pip" install --quiet --no-cache-dir "$SRC/llama_cpp_python-$VERSION"
echo "built in $(( $(date +%s) - start )) s"
# the GGUF converter runs with the project's interpreter (torch, transformers); it also imports sentencepiece,
# kept in a folder of its own so the project's environment is not changed
"$VENV/bin/pip" install --quiet --target "$HOME_DIR/convert-deps" sentencepiece
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready:', llama_cpp.llama_print_system_info().decode())"
