#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs what CI runs: ruff, the nvcc compile check, the CPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ -f scripts/check_nvcc.sh ]; then bash scripts/check_nvcc.sh; fi
# Triton kernels run under the interpreter on CPU; slow tests stay out of CI.
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -m "not slow" "$@"
