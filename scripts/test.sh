#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite on two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
# two workers share the cores: OpenMP threads that spin would take turns with the other worker's
export OMP_WAIT_POLICY=PASSIVE
# install.sh built llama-cpp-python: its tests must run here, not be skipped as where it is not installed
export SPECSAMPLE_TESTS_NEED_LLAMACPP=1
# loadgroup: tests marked with one xdist_group share a worker (test_ray_serve.py: one Ray cluster, not two)
python -m pytest -q -n 2 --dist loadgroup --durations=25 "$@"
