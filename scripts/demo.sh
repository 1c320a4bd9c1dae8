#!/usr/bin/env bash
# Sets up .venv and runs the demo: a BART-base-shaped model with random weights generates
# (beam 4, no-repeat 3) upstream and with fastgen; prints both outputs and the measured ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m benchmarks.run --scenario bart-base --device auto --no-save "$@"
