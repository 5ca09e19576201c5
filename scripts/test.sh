#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite on two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
python -m pytest -q -n 2 "$@"
