"""Compile the Triton attention kernels for a real GPU target without a GPU (run as a script).

The interpreter checks the numerics but not what only the compiler sees (layouts, register
use). ``python -m tests.ops.triton_compile_check`` compiles the launcher's own tile configs for
sm_90 with the argument specialisations a contiguous launch gets, and reports ptxas' register
and stack (spill) use. Prints one line per config; exits non-zero on a compile error or a spill.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastgen.ops.triton import attention as kernels

TARGET = GPUTarget("cuda", 90, 32)
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_ms"}  # contiguous last axes
TRITON_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _specialised(fn, pointer_types: dict[str, str], constants: dict[str, object]) -> ASTSource:
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name], constexprs[(index,)] = "constexpr", constants[name]
        elif name in UNIT_STRIDES:
            signature[name], constexprs[(index,)] = "constexpr", 1
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


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


def check(dtype: torch.dtype, dim: int, n_rows: int, mask: str, split: bool) -> tuple[str, bool]:
    """Compile one config; ``mask`` is none, bool-input, bool-hyp, float-input or float-hyp."""
    block_d = max(16, triton.next_power_of_2(dim))
    block_m, block_n, num_warps = kernels._tile_config(dtype, n_rows, block_d)
    ty = TRITON_DTYPES[dtype]
    constants = {
        "KV_HEADS": 8, "GROUP": 4, "HEAD_GROUP": max(1, n_rows // 4), "Q_LEN": 1, "HEAD_DIM": dim, "VALUE_DIM": dim,
        "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "BLOCK_DV": block_d, "HAS_MASK": mask != "none",
        "MASK_IS_BOOL": mask.startswith("bool"), "MASK_PER_ROW": mask.endswith("hyp"), "SPLIT": split,
        "UPCAST_DOT": False,
    }  # fmt: skip
    pointers = {"Q": f"*{ty}", "K": f"*{ty}", "V": f"*{ty}", "Mask": "*u8" if mask.startswith("bool") else f"*{ty}"}
    pointers |= {"Out": "*fp32" if split else f"*{ty}", "Lse": "*fp32", "RowSum": "*fp32"}
    source = _specialised(kernels._shared_kv_attention_kernel, pointers, constants)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps})
    usage = _usage(compiled)
    line = (
        f"{ty} D={dim} rows={n_rows} mask={mask} split={split}: BLOCK_M={block_m} BLOCK_N={block_n} warps={num_warps}"
    )
    return f"{line} regs/stack={usage}", usage is None or usage[1] == 0


def main() -> int:
    ok = True
    configs = [(torch.float16, 64, 4, "bool-input", False), (torch.float16, 64, 4, "bool-hyp", True)]
    configs += [(torch.float16, 128, 32, "float-hyp", True), (torch.bfloat16, 128, 64, "none", False)]
    configs += [(torch.float32, 64, 8, "bool-input", True), (torch.bfloat16, 256, 16, "float-input", False)]
    for config in configs:
        line, fine = check(*config)
        print(line)
        ok &= fine
    combine = kernels._combine_splits_kernel
    pointers = {"PartOut": "*fp32", "PartMax": "*fp32", "PartSum": "*fp32", "Out": "*fp16", "Lse": "*fp32"}
    constants = {"KV_HEADS": 8, "GROUP": 4, "HEAD_GROUP": 1, "Q_LEN": 1, "VALUE_DIM": 64, "BLOCK_M": 16, "BLOCK_DV": 64}
    triton.compile(_specialised(combine, pointers, constants), target=TARGET, options={"num_warps": 4})
    print("combine kernel: compiled")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
