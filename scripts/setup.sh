#!/usr/bin/env bash
# Creates .venv with a CPU torch, transformers, triton, fairseq (ve-fairseq, --no-deps) and fastgen.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! { [ -x .venv/bin/ruff ] && "$VPY" -c "import fastgen, transformers, triton, fairseq, pytest, hypothesis"; } >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  # torch: the CPU build (a plain "torch" may pull a multi-GB CUDA build). Keep a torch already present.
  "$VPY" -c "import torch" >/dev/null 2>&1 || "$VPY" -m pip install -q "torch==${FASTGEN_TORCH_VERSION:-2.13.0}"
  "$VPY" -m pip install -q -r requirements-dev.txt
  # fairseq 0.12.2 does not import on Python 3.11; ve-fairseq 0.12.3 does. --no-deps: its
  # torchaudio requirement would pull a CUDA torchaudio that cannot load beside a CPU torch.
  "$VPY" -m pip install -q --no-deps "ve-fairseq==0.12.3"
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
fi
