"""``python -m fastgen.info``: versions, the compiled extension's state, and every patch's state."""

from __future__ import annotations

import importlib
import platform

import torch

import fastgen
from fastgen.optimizer.registry import installed_version


def report() -> str:
    lines = [
        f"fastgen {fastgen.__version__}  python {platform.python_version()}  torch {torch.__version__}",
        f"transformers {installed_version('transformers')}  fairseq {installed_version('fairseq')}  "
        f"triton {installed_version('triton')}",
        f"CUDA device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
        f"compiled extension: {_extension_state()}",
        "",
        str(fastgen.status()),
    ]
    return "\n".join(lines)


def _extension_state() -> str:
    try:
        ext = importlib.import_module("fastgen.ops._ext")
    except ImportError as exc:
        return f"loader unavailable ({exc})"
    module = ext.load()
    return f"loaded from {getattr(module, '__file__', module)}" if module else f"not loaded: {ext.unavailable_reason()}"


if __name__ == "__main__":
    print(report())
