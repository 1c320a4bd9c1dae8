"""Compile the Triton attention kernels for a real GPU target without a GPU (run as a script).

The interpreter checks the numerics but not what only the compiler sees (layouts, tensor-core
use, registers). ``python -m tests.ops.triton_compile_check`` plans real calls on ``meta``
tensors with the launcher's own :func:`~fastgen.ops.triton.attention.plan`, specialises the
arguments the way Triton's JIT does, compiles every launch for sm_90 and reports ptxas'
registers and stack (spill) bytes. Exits non-zero on a compile error or a stack over
``MAX_STACK`` bytes (spills beyond a pointer or two parked across the key loop). Needs no GPU,
only the NVIDIA backend Triton wheels ship (ptxas included); must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from fastgen.ops.triton import attention as kernels

TARGET = GPUTarget("cuda", 90, 32)
MAX_STACK = 16  # seen: 8 bytes, one 64-bit pointer stored before the key loop and reloaded after it

# (name, dtype, B, G, H, Hkv, q, S, D, mask, num_splits); mask: none | bool-input | bool-hyp | float-hyp
CALLS = [
    ("decode, per-input mask", torch.float16, 32, 4, 16, 16, 1, 1000, 64, "bool-input", None),
    ("decode, per-beam mask, split", torch.float16, 32, 4, 16, 16, 1, 1000, 64, "bool-hyp", 4),
    ("GQA 4, bias, split", torch.bfloat16, 4, 4, 32, 8, 1, 3001, 128, "float-hyp", 8),
    ("GQA 8, q=2: 128 rows", torch.float16, 2, 8, 32, 4, 2, 500, 128, "bool-input", None),
    ("fp32, q=3", torch.float32, 2, 2, 4, 4, 3, 200, 64, "none", None),
    ("head dim 256", torch.bfloat16, 2, 4, 8, 8, 1, 300, 256, "none", None),
]


def _meta_call(dtype, batch, group, heads, kv_heads, q_len, kv_len, dim, mask):
    def empty(*shape, dtype=dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    query, key = empty(batch * group, heads, q_len, dim), empty(batch, kv_heads, kv_len, dim)
    value = empty(batch, kv_heads, kv_len, dim)
    rows = batch * group if mask.endswith("hyp") else batch
    attn_mask = None if mask == "none" else empty(rows, 1, 1, kv_len, dtype=torch.bool if "bool" in mask else dtype)
    return query, key, value, attn_mask


def _source(launch: kernels.Launch) -> ASTSource:
    """The ASTSource Triton's JIT would build for these arguments (same specialisation rules)."""
    names = launch.kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for index, arg in enumerate(launch.args):
        kind, spec = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[names[index]] = kind
        if kind == "constexpr":
            constexprs[(index,)] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in launch.constants.items():
        index = names.index(name)
        signature[name], constexprs[(index,)] = "constexpr", value
    return ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _usage(compiled) -> tuple[int, int] | None:
    """(registers, stack bytes) from cuobjdump, or None where the tool is missing."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def main() -> int:
    ok = True
    for name, dtype, *shape, mask, num_splits in CALLS:
        _, _, launches = kernels.plan(*_meta_call(dtype, *shape, mask), num_splits=num_splits)
        for launch in launches:
            compiled = triton.compile(_source(launch), target=TARGET, options={"num_warps": launch.num_warps})
            usage = _usage(compiled)
            tiles = {k: launch.constants[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_DV") if k in launch.constants}
            tensor_cores = any(op in compiled.asm["ptx"] for op in ("mma.sync", "wgmma"))
            print(
                f"{name} ({dtype}): {launch.kernel.__name__} grid={launch.grid} {tiles} warps={launch.num_warps} "
                f"tensor_cores={tensor_cores} registers/stack={usage}"
            )
            ok &= usage is None or usage[1] <= MAX_STACK
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
