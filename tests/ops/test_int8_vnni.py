"""fastgen's fused int8 ops (``fastgen_cpu::int8_linear_vnni`` and ``int8_linear_amx``) and ``auto``'s choice.

What is asserted:

* the packed layout is the one ``vpdpbusd`` reads (16 outputs x 4 consecutive k per 64 bytes, zeros past the
  weight's edges);
* each op (VNNI registers; AMX tiles where the CPU and OS give them) computes the asymmetric grid's formula
  with exact integer sums: against the row quantizer's codes multiplied in int64 and scaled in the same order,
  for row counts, widths and depths that are not multiples of the tiles (8 or 32 rows, 48 or 32 outputs, 4 or
  64 k), with and without bias, each fused activation, and rows holding NaN or infinity (NaN out, other rows
  untouched);
* they return oneDNN's path's bits (same codes, sums and scaling), so ``auto``'s timed choice between the two
  at a weight's first product moves no result; the choice and its timings are recorded.
"""

import pytest
import torch

from fastgen.ops import cpu_kernels, int8_linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))
#: the op runs everywhere its kernels build (a plain loop without VNNI: the AVX2 build's test runs that);
#: ``auto`` chooses it only where it is native
native = pytest.mark.skipif(not int8_linear.has_vnni_kernel(), reason="no AVX-512 VNNI kernel here")
OPS = ["int8_linear_vnni", "int8_linear_amx"]


@pytest.fixture(params=OPS)
def op_name(request):
    if request.param == "int8_linear_amx" and not torch.ops.fastgen_cpu.int8_amx_ready():
        pytest.skip("no AMX here (CPU, kernel or build)")
    return request.param


SHAPES = [
    (1, 8, 16),
    (5, 37, 50),
    (8, 64, 48),
    (16, 256, 256),
    (19, 130, 97),
    (33, 70, 31),
    (64, 100, 200),
    (130, 20, 33),
    (40, 96, 613),  # several AMX chunks of 256 outputs, the last one ragged
]


def _emulated(x, weight, bias, activation):
    """The op's formula in torch (the kernel's own row codes, int64 sums, its scaling order) and a bound well
    under one integer step of the sum (``scale_w * scale``) but above float rounding of the terms."""
    codes, scale, zero = torch.ops.fastgen_cpu.quantize_rows_u8_zp(x)
    wq, scale_w = int8_linear.quantize_weight(weight)
    acc = codes.to(torch.int64) @ wq.to(torch.int64).t()
    col_sums = wq.sum(dim=1, dtype=torch.int32).to(torch.float32) * scale_w
    y = (acc.to(torch.float32) * scale_w - zero * col_sums) * scale
    y = y if bias is None else y + bias
    bound = 0.25 * scale_w * scale + 1e-6 * (acc.abs() * scale_w + zero.abs() * col_sums.abs()) * scale
    return (int8_linear.ACTIVATIONS[activation](y) if activation else y), 1.2 * bound + 1e-6


def _op(x, weight, bias, activation, name="int8_linear_vnni"):
    wq, scale_w = int8_linear.quantize_weight(weight)
    col_sums = wq.sum(dim=1, dtype=torch.int32).to(torch.float32) * scale_w
    packed = torch.ops.fastgen_cpu.pack_int8_vnni(wq)
    op = getattr(torch.ops.fastgen_cpu, name)
    return op(x, packed, weight.shape[0], scale_w, col_sums, bias, activation)


def test_the_packed_layout_is_what_vpdpbusd_reads():
    codes = torch.arange(-60, 60, dtype=torch.int8)[: 17 * 7].reshape(17, 7)  # 17 outputs, 7 k: both edges ragged
    packed = torch.ops.fastgen_cpu.pack_int8_vnni(codes)
    assert packed.shape == (2, 16, 16, 4)  # k padded to a whole 64-byte block (16 groups of four)
    for n in range(17):
        for k in range(7):
            assert packed[n // 16, k // 4, n % 16, k % 4] == codes[n, k]
    assert packed[1, :, 1:].eq(0).all() and packed[:, 1, :, 3].eq(0).all() and packed[:, 2:].eq(0).all()


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_sums_exactly_and_scales_in_order(m, k, n, bias, op_name):
    generator = torch.Generator().manual_seed(m * 1000 + k + n)
    weight = torch.randn(n, k, generator=generator) * 0.2
    b = torch.randn(n, generator=generator) if bias else None
    x = torch.randn(m, k, generator=generator) * 3
    x[0, : k // 2] = 0.0  # a row with exact zeros
    for activation in (0, *int8_linear.ACTIVATIONS):
        got = _op(x, weight, b, activation, op_name)
        want, bound = _emulated(x, weight, b, activation)
        assert ((got - want).abs() <= bound).all(), (activation, ((got - want).abs() / bound).max())


@pytest.mark.parametrize("m,k,n", [(200, 512, 1030), (70, 300, 613), (16, 72, 96)])
def test_the_thread_count_moves_no_bit(m, k, n, op_name):
    """Large enough that 2 and 3 threads split the outputs (each share a whole number of chunks)."""
    generator = torch.Generator().manual_seed(m + n)
    weight, bias = torch.randn(n, k, generator=generator), torch.randn(n, generator=generator)
    x = torch.randn(m, k, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [_op(x, weight, bias, activation, op_name) for activation in (0, 1)]
        for count in (2, 3):
            torch.set_num_threads(count)
            assert all(torch.equal(_op(x, weight, bias, a, op_name), one[a]) for a in (0, 1)), count
    finally:
        torch.set_num_threads(threads)


def test_rows_with_nan_or_inf_come_out_nan_and_the_others_are_untouched(op_name):
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    clean = torch.randn(6, 24, generator=generator)
    x = clean.clone()
    x[1, 2], x[2, 5], x[3, 0] = float("nan"), float("inf"), float("-inf")
    got = _op(x, weight, bias, 0, op_name)
    assert got[1:4].isnan().all() and not got[[0, 4, 5]].isnan().any()
    assert torch.equal(got[[0, 4, 5]], _op(clean, weight, bias, 0, op_name)[[0, 4, 5]])


@native
@pytest.mark.skipif(not int8_linear._has_onednn(), reason="no oneDNN quantized linear here")
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_ops_give_onednns_bits(m, k, n):
    generator = torch.Generator().manual_seed(n)
    weight, bias = torch.randn(n, k, generator=generator), torch.randn(n, generator=generator)
    x = torch.randn(m, k, generator=generator)
    onednn = int8_linear.Int8Weight(weight, "onednn")
    own = [int8_linear.Int8Weight(weight, "vnni")]
    if int8_linear.has_amx_kernel():
        own.append(int8_linear.Int8Weight(weight, "amx"))
    assert onednn.kind == "onednn" and [w.kind for w in own] == ["vnni", "amx"][: len(own)]
    for activation in (0, int8_linear.GELU):
        expected = onednn.matmul(x, bias, activation)
        for prepared in own:
            assert torch.equal(prepared.matmul(x, bias, activation), expected), prepared.kind


@native
@pytest.mark.skipif(not int8_linear._has_onednn(), reason="no oneDNN quantized linear here")
def test_auto_times_both_at_the_first_product_and_keeps_the_faster():
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(12, 64)
    chosen = int8_linear.Int8Weight(weight, "auto")
    first = chosen.matmul(x, bias)
    candidates = {"vnni", "onednn"} | ({"amx"} if int8_linear.has_amx_kernel() else set())
    assert chosen.kind in candidates and set(chosen.choice_ms) == candidates
    assert chosen.kind == int8_linear.preferred_kind(chosen.choice_ms)
    assert torch.equal(first, int8_linear.Int8Weight(weight, "onednn").matmul(x, bias))
    assert torch.equal(chosen.matmul(x, bias), first)


@native
def test_a_grid_switched_to_symmetric_later_is_honoured(monkeypatch):
    """A weight that chose fastgen's op (asymmetric grid) computes the symmetric grid once ``GRID`` says so."""
    generator = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(40, 70, generator=generator), torch.randn(40, generator=generator)
    x = torch.randn(6, 70, generator=generator)
    x[2, 3] = float("nan")
    prepared = int8_linear.Int8Weight(weight, "vnni")
    asymmetric = prepared.matmul(x, bias)
    monkeypatch.setattr(int8_linear, "GRID", "symmetric")
    symmetric = prepared.matmul(x, bias)
    reference = int8_linear.int8_linear_reference(x, weight, bias, grid="symmetric")
    assert torch.equal(symmetric.isnan(), reference.isnan()) and symmetric[2].isnan().all()
    keep = ~reference.isnan()
    assert torch.allclose(symmetric[keep], reference[keep], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(asymmetric[keep], reference[keep], rtol=1e-5, atol=1e-5)  # the grid did change


def test_preferred_kind_takes_onednn_only_by_the_margin():
    margin = int8_linear.ONEDNN_MARGIN
    assert int8_linear.preferred_kind({"onednn": 1.0, "vnni": 2.0, "amx": 1.5}) == "onednn"
    assert int8_linear.preferred_kind({"onednn": 1.0, "vnni": 1.2, "amx": 1.04}) == "amx"  # a near tie: own op
    assert int8_linear.preferred_kind({"onednn": margin * 2.0, "vnni": 2.0}) == "onednn"
    assert int8_linear.preferred_kind({"onednn": 3.0, "vnni": 2.0, "amx": 2.5}) == "vnni"
