#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs what CI runs: ruff, the nvcc compile check, the CPU
# test suite on the newest transformers, then the Transformers tests on the oldest supported one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/check_nvcc.sh
# Triton kernels run under the interpreter on CPU (tests/conftest.py); slow tests stay out of CI.
.venv/bin/python -m pytest -q -m "not slow" "$@"
# Oldest supported transformers: patches outside their tested range must skip and leave upstream intact.
VENV=.venv-oldest TRANSFORMERS="transformers==5.15.1" bash scripts/setup.sh
.venv-oldest/bin/python -m pytest -q -m "not slow" -p no:cacheprovider tests/test_harness.py tests/models tests/optimizer "$@"
