#!/usr/bin/env bash
# Creates a virtual environment (default .venv) with torch, transformers, triton, fairseq (ve-fairseq,
# --no-deps) and fastgen. Idempotent: a second run only checks what is installed.
#   bash scripts/setup.sh --cpu    # torch's CPU build: adds https://download.pytorch.org/whl/cpu as an extra index
#   VENV=.venv-oldest TRANSFORMERS="transformers==5.15.1" bash scripts/setup.sh   # another version
# torch comes from whatever index pip is configured with. From the public index that is the CUDA build
# on Linux (several GB); --cpu (or FASTGEN_TORCH_INDEX=URL) picks another source. A torch already in the
# environment is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_INDEX=${FASTGEN_TORCH_INDEX:-}
for arg in "$@"; do
  case "$arg" in
    --cpu) TORCH_INDEX=https://download.pytorch.org/whl/cpu ;;
    *) echo "usage: bash scripts/setup.sh [--cpu]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TRANSFORMERS=${TRANSFORMERS:-}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
want_check="import fastgen, transformers, triton, fairseq, pytest, hypothesis, mkdocs, material, mkdocstrings, build"
if [ -n "$TRANSFORMERS" ]; then
  want_check="$want_check; from packaging.requirements import Requirement as R; import sys; \
sys.exit(transformers.__version__ not in R('$TRANSFORMERS').specifier)"
fi
if ! { [ -x "$VENV/bin/ruff" ] && [ -x "$VENV/bin/fastgen-generate-hf" ] && "$VPY" -c "$want_check"; } >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  # torch from pip's configured index, or the one --cpu / FASTGEN_TORCH_INDEX names. Keep a torch already present.
  "$VPY" -c "import torch" >/dev/null 2>&1 || "$VPY" -m pip install -q ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
    "torch==${FASTGEN_TORCH_VERSION:-2.13.0}"
  # shellcheck disable=SC2086
  "$VPY" -m pip install -q -r requirements-dev.txt $TRANSFORMERS
  # fairseq 0.12.2 does not import on Python 3.11; ve-fairseq 0.12.3 does. --no-deps: its
  # torchaudio requirement would pull a CUDA torchaudio that cannot load beside a CPU torch.
  "$VPY" -m pip install -q --no-deps "ve-fairseq==0.12.3"
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
fi
