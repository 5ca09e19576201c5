#!/usr/bin/env bash
# Builds llama.cpp's own decoding tools, the baselines of `specsample bench run --backend llamacpp`
# (docs/llamacpp-backend.md, "llama.cpp's own baselines"): llama-lookup (prompt-lookup decoding),
# llama-speculative-simple and llama-speculative (draft-model speculative decoding), llama-simple
# and llama-bench, from the llama.cpp that llama-cpp-python's sdist vendors (the version the
# llamacpp backend runs), into a cache directory:
#
#   ${SPECSAMPLE_LLAMACPP_TOOLS:-~/.cache/specsample/llamacpp-tools}/bin/llama-*
#
# Not part of scripts/install.sh or CI: only the benchmarks use the tools, and the build takes
# about as long as install.sh's llama-cpp-python build (ggml's CPU backend once per x86 feature
# level). The flags are install.sh's, so the tools run on AVX2-only and AVX-512/AMX machines
# alike (no -march=native, no AVX-512 hard-coded: ggml loads the best CPU variant at run time)
# and without llamafile kernels. Usage:
#
#   bash scripts/build_llamacpp_tools.sh            # sdist from PyPI through pip, unless SDIST is given
#   SDIST=/tmp/sdist/llama_cpp_python-0.3.36.tar.gz bash scripts/build_llamacpp_tools.sh
#   JOBS=1 nice -n 19 bash scripts/build_llamacpp_tools.sh
#   BUILD_DIR=/tmp/llamacpp-tools-build bash scripts/build_llamacpp_tools.sh   # keep the build tree
#   PATCHED=1 bash scripts/build_llamacpp_tools.sh   # with the project's batch-invariant patch
#
# PATCHED=1 applies scripts/llama-cpp-batch-invariant.patch (as install.sh does to the backend's
# llama.cpp) and installs into ~/.cache/specsample/llamacpp-tools-batch-invariant: tools whose
# greedy output does not depend on how many tokens a pass holds, the same numerics as the
# llamacpp backend, so that `llama-lookup` decodes the same text as plain decoding and the speed
# comparison is over equal answers (the baseline `llamacpp-lookup-invariant`).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36  # llama-cpp-python, as scripts/install.sh pins it
PATCHED="${PATCHED:-0}"
if [ "$PATCHED" = 1 ]; then
    DEST="${SPECSAMPLE_LLAMACPP_INVARIANT_TOOLS:-$HOME/.cache/specsample/llamacpp-tools-batch-invariant}"
else
    DEST="${SPECSAMPLE_LLAMACPP_TOOLS:-$HOME/.cache/specsample/llamacpp-tools}"
fi
JOBS="${JOBS:-$(nproc)}"
TOOLS=(llama-lookup llama-speculative-simple llama-speculative llama-simple llama-bench)
PIP=pip
[ -x .venv/bin/pip ] && PIP=.venv/bin/pip

if [ -n "${BUILD_DIR:-}" ]; then  # kept, so that a second run only rebuilds what changed
    work="$BUILD_DIR"
    mkdir -p "$work"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
fi
if [ -z "${SDIST:-}" ]; then
    "$PIP" download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$work"
    SDIST="$(ls "$work"/llama_cpp_python-"$VERSION".tar.gz)"
fi
if [ ! -d "$work/llama_cpp_python-$VERSION" ]; then
    tar -xzf "$SDIST" -C "$work"
    if [ "$PATCHED" = 1 ]; then
        patch_file="$PWD/scripts/llama-cpp-batch-invariant.patch"
        (cd "$work/llama_cpp_python-$VERSION" && git apply -p0 "$patch_file")
    fi
fi
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $SDIST" >&2; exit 1; }

echo "building ${TOOLS[*]} from llama-cpp-python $VERSION's llama.cpp into $DEST ($JOBS jobs)" >&2
# GGML_NATIVE=OFF + GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS: runtime CPU dispatch, as install.sh.
# GGML_LLAMAFILE=OFF: as install.sh (batch-invariant kernels). No server, UI, tests or TLS:
# nothing is fetched at configure time.
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_LLAMAFILE=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON >"$work/configure.log" \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
# The CPU variants are modules loaded at run time, not link dependencies of the tools: named here.
variants=($(ninja -C "$work/build" -t targets all | sed -n 's/^\(ggml-cpu-[A-Za-z0-9_.]*\):.*/\1/p' | sort -u))
[ "${#variants[@]}" -gt 0 ] || { echo "no ggml CPU variants configured" >&2; exit 1; }
cmake --build "$work/build" -j "$JOBS" --target "${TOOLS[@]}" "${variants[@]}"

# Executables, libllama/libggml* and every CPU variant in one directory: the tools find the
# libraries through their $ORIGIN rpath, and ggml looks for the variants next to the executable.
rm -rf "$DEST.new"
mkdir -p "$DEST.new/bin"
for tool in "${TOOLS[@]}"; do cp "$work/build/bin/$tool" "$DEST.new/bin/"; done
find "$work/build" -name '*.so*' \( -type f -o -type l \) -exec cp -P {} "$DEST.new/bin/" \;
echo "llama-cpp-python $VERSION$([ "$PATCHED" = 1 ] && echo ', batch-invariant patch')" >"$DEST.new/VERSION"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"
"$DEST/bin/llama-lookup" --version 2>&1 | head -2 >&2 || true
echo "llama.cpp tools in $DEST/bin" >&2
