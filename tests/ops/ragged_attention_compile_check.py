"""Compile the ragged-attention Triton kernel for sm_90 without a GPU (run as a script).

    python -m tests.ops.ragged_attention_compile_check

The interpreter checks numerics, not what only the compiler sees; this compiles real launches
(fp16/bf16/fp32, decode and verify shapes) and reports whether the dots use tensor cores
(fp16/bf16 should; fp32 uses IEEE products on purpose). Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastgen.ops.triton.ragged_attention import _ragged_attention_kernel as kernel

# (dtype, q, width, head dim, heads, GQA group)
CALLS = [("fp16", 8, 300, 64, 8, 2), ("bf16", 1, 1000, 128, 32, 4), ("fp32", 5, 200, 64, 4, 1)]


def compile_call(dtype: str, q_len: int, width: int, dim: int, heads: int, group: int):
    names = kernel.arg_names
    signature, constexprs = {}, {}
    for name in names:
        if name in ("Q", "K", "V", "Out"):
            signature[name] = "*" + dtype
        elif name == "Lengths":
            signature[name] = "*i32"
        elif name.startswith("stride"):
            signature[name] = "i32"
        elif name == "scale":
            signature[name] = "fp32"
    constants = dict(
        HEADS=heads,
        GROUP=group,
        Q_LEN=q_len,
        WIDTH=width,
        DIM=dim,
        BLOCK_M=max(16, triton.next_power_of_2(q_len)),
        BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )
    for name, value in constants.items():
        signature[name] = "constexpr"
        constexprs[(names.index(name),)] = value
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main() -> int:
    ok = True
    for call in CALLS:
        compiled = compile_call(*call)
        tensor_cores = any(op in compiled.asm["ptx"] for op in ("mma.sync", "wgmma"))
        print(f"{call}: compiled for sm_90, tensor cores: {tensor_cores}")
        ok &= tensor_cores == (call[0] != "fp32")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
