"""``python -m fastgen.info``: versions, the compiled extension, op backends, and every patch's state.

Transformers' patched modules are imported first so their patches show as applied or skipped;
fairseq is not imported (slow, and it reconfigures logging), so its patches may show as pending.
It never compiles anything: the CPU kernels' line says whether they are prebuilt, cached, not built yet
or unavailable (and why); ``python -m fastgen.info --build`` loads them, building them if need be.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import textwrap

import torch

import fastgen
from fastgen.optimizer.registry import declared_patches, installed_version

#: op modules that expose ``available_backends(device) -> {backend: reason or None}``
OPS = ("fastgen.ops.ngram", "fastgen.ops.attention", "fastgen.ops.beam_topk")


def report() -> str:
    _import_transformers_targets()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        f"fastgen {fastgen.__version__}  python {platform.python_version()}  torch {torch.__version__}",
        f"transformers {installed_version('transformers')}  fairseq {installed_version('fairseq')}  "
        f"triton {installed_version('triton')}",
        *_transformers_contract_lines(),
        f"CUDA device: {torch.cuda.get_device_name() if device == 'cuda' else 'none'}",
        f"compiled extension: {_extension_state()}",
        f"op backends on {device}:",
        *[f"  {line}" for line in _backend_lines(device)],
        *_cpu_mode_lines(),
        "",
        str(fastgen.status()),
    ]
    return "\n".join(lines)


def _import_transformers_targets() -> None:
    if installed_version("transformers") is None:
        return
    for module in {p.module for p in declared_patches() if p.package == "transformers"}:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def _transformers_contract_lines() -> list[str]:
    """Whether the installed Transformers has the structure fastgen's fast paths were tested on."""
    if installed_version("transformers") is None:
        return []
    from fastgen.optimizer.transformers import contract

    problem = contract.problem()
    state = "ok" if problem is None else problem
    return textwrap.wrap(
        f"transformers fast paths (tested up to {contract.NEWEST_TESTED}): {state}", 80, subsequent_indent="  "
    )


def _extension_state() -> str:
    from fastgen.ops import _ext

    module = _ext.load()
    if module is None:
        return f"not loaded: {_ext.unavailable_reason()}"
    return f"loaded from {getattr(module, '__file__', module)}"


def _backend_lines(device: str) -> list[str]:
    lines = []
    for name in OPS:
        backends = importlib.import_module(name).available_backends(device)
        states = [f"{b}: {'ok' if reason is None else reason}" for b, reason in backends.items()]
        lines.append(f"{name.rsplit('.', 1)[-1]}: " + "; ".join(states))
    return lines


def _cpu_mode_lines() -> list[str]:
    """The opt-in CPU linear modes' kernels here (fast_gemm: oneDNN; int8: fbgemm, oneDNN or torch._int_mm)."""
    from fastgen.ops import cpu_attention, cpu_kernels, fast_linear, int8_linear

    isa = [flag for flag in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if flag in int8_linear.cpu_flags()]
    int8 = int8_linear.unavailable() or (
        f"{int8_linear.backend()}"
        + (" (oneDNN with the CPU kernels, else per weight)" if int8_linear.backend() == "auto" else "")
        + (", 7-bit activations (no VNNI)" if int8_linear.reduce_range() else "")
    )
    kernels = cpu_kernels.describe()  # builds nothing
    lines = [
        f"CPU instruction sets: {', '.join(isa) or 'unknown'}",
        f"  fast_gemm (oneDNN packed fp32): {fast_linear.unavailable() or 'ok'}",
        f"  int8: {int8}",
        *textwrap.wrap(f"  CPU kernels (csrc/cpu): {kernels}", 100, subsequent_indent="    "),
    ]
    if os.environ.get("FASTGEN_CPU_ATTENTION", "1").strip().lower() in cpu_kernels.OFF:
        attention = "off (FASTGEN_CPU_ATTENTION=0)"
    elif kernels.startswith(("off", "unavailable")):
        attention = "off (no CPU kernels)"
    elif cpu_kernels.loaded():  # asking cpu_attention builds nothing once they are loaded
        reason = cpu_attention.unavailable_reason()
        attention = "on" if reason is None else f"off ({reason})"
    else:
        attention = "on once the CPU kernels are loaded"
    lines.append(f"  attention kernel (fast modes): {attention}")
    if os.environ.get("FASTGEN_EXACT_KERNEL", "1").strip().lower() in cpu_kernels.OFF:
        ordered = "off (FASTGEN_EXACT_KERNEL=0)"
    elif kernels.startswith(("off", "unavailable")):
        ordered = "off (no CPU kernels): F.linear and its blocked forms"
    else:
        ordered = "calibrated per shape against F.linear, kept only where identical and faster"
    lines.append(f"  ordered GEMM (exact mode): {ordered}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fastgen.info", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--build", action="store_true", help="load fastgen's CPU kernels first, building them if need be"
    )
    if parser.parse_args(argv).build:
        from fastgen.ops import cpu_kernels

        cpu_kernels.unavailable_reason()
    print(report())


if __name__ == "__main__":
    main()
