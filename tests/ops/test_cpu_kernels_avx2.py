"""fastgen's CPU kernels built for AVX2 (``FASTGEN_CPU_MARCH=haswell``): the 8-lane code path, which an
AVX-512 machine (where the suite usually runs) would never build, checked against the same references.

Runs the kernel tests of ``test_cpu_attention.py``, ``test_cpu_topk.py``, ``test_int8_vnni.py`` (the op's plain
loop, which this build runs) and ``test_int8.py``'s fused-pass test (not its ``vnni`` case: that kind needs the
native op) in a subprocess whose kernels were built with ``-march=haswell`` (they run on any AVX2 CPU).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastgen.ops import int8_linear

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif("avx2" not in int8_linear.cpu_flags(), reason="no AVX2 on this CPU")
def test_the_avx2_build_computes_the_references():
    env = {**os.environ, "FASTGEN_CPU_MARCH": "haswell"}
    env.pop("FASTGEN_CPU_KERNELS", None)
    tests = [
        "tests/ops/test_cpu_attention.py::test_the_kernel_builds_where_a_compiler_is_present",
        "tests/ops/test_cpu_attention.py::test_kernel_is_its_reference_and_sdpa_to_float_rounding",
        "tests/ops/test_cpu_attention.py::test_a_fully_masked_row_gives_zeros",
        "tests/ops/test_cpu_topk.py::test_top_k_is_torch_topk_bit_for_bit",
        "tests/ops/test_cpu_topk.py::test_rows_with_ties_or_too_few_finite_values_are_flagged",
        "tests/optimizer/test_int8.py::test_fused_kernels_compute_what_torch_ops_compute",
        "tests/optimizer/test_fused_activation.py::test_kernel_activations_are_torch_to_float_rounding",
        "tests/ops/test_int8_vnni.py::test_the_packed_layout_is_what_vpdpbusd_reads",
        "tests/ops/test_int8_vnni.py::test_the_op_sums_exactly_and_scales_in_order",
        "tests/ops/test_int8_vnni.py::test_rows_with_nan_or_inf_come_out_nan_and_the_others_are_untouched",
        "tests/optimizer/test_weight_updates.py::test_the_hash_kernel_computes_its_lanes_formula",
    ]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-k",
            "not vnni] and not amx] and not int8_linear_amx",  # AMX: not in an AVX2 build
            *tests,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-1000:]
