"""fastgen's ordered GEMM (``fastgen_cpu::ordered_linear``) and the exact mode's use of it.

What is asserted:

* the kernel computes exactly the order it is given: per output element the bias (first or last) and,
  per block of ``block`` consecutive k, a sequential chain of fused multiply-adds, bit for bit against an
  emulation of that order in float64 (exact products and sums, one rounding to float32 per step);
* :func:`fastgen.ops.linear.exact_linear` with the kernel calibrated in returns ``F.linear``'s bits on
  every input, whatever the shape, row count, bias, contiguity, denormals, infinities or NaNs (hypothesis);
* a calibration never keeps an order that differs (a wrong one planted), a zero bias cannot hide the
  bias's place, and ``FASTGEN_EXACT_KERNEL=0`` keeps the kernel out.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgen.ops import cpu_kernels, linear

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma: the float64 product of two float32 is exact; the sum is rounded once to float64 and
    once to float32 (a double rounding that differs from one rounding with probability ~2**-29)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def emulate(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, block: int, bias_last: bool) -> torch.Tensor:
    xs, ws = x.numpy(), w.numpy()
    m, k = xs.shape
    n = ws.shape[0]
    total = None
    for k0 in range(0, k, block):
        s = np.zeros((m, n), np.float32)
        for j in range(k0, min(k, k0 + block)):
            s = _fma32(xs[:, j : j + 1], ws[None, :, j], s)
        if total is None:
            total = s if bias is None or bias_last else (bias.numpy()[None, :] + s).astype(np.float32)
        else:
            total = (total + s).astype(np.float32)
    if total is None:
        total = np.zeros((m, n), np.float32) if bias is None else np.broadcast_to(bias.numpy(), (m, n)).copy()
    elif bias is not None and bias_last:
        total = (total + bias.numpy()[None, :]).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(total))


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 200),
    n=st.integers(1, 60),
    block=st.sampled_from([1, 7, 64, 96, 192, 384]),
    bias=st.sampled_from([None, "first", "last"]),
    seed=st.integers(0, 10**6),
)
def test_kernel_computes_the_order_it_is_given(m, k, n, block, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) * 0.1
    b = None if bias is None else torch.randn(n, generator=generator)
    got = torch.ops.fastgen_cpu.ordered_linear(x, w, b, block, int(bias == "last"))
    assert torch.equal(got, emulate(x, w, b, block, bias == "last"))


@needs_kernels
@pytest.mark.parametrize("m", [17, 48, 64, 80, 200, 257, 300])
@pytest.mark.parametrize("bias", [None, "first", "last"])
def test_every_row_tiling_computes_the_order(m, bias):
    """Row counts that take each tiling: 2-4 row vectors per tile, several tiles, the packed panels (> 256)."""
    generator = torch.Generator().manual_seed(m)
    k, n, block = 70, 29, 32
    x = torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) * 0.1
    b = None if bias is None else torch.randn(n, generator=generator)
    got = torch.ops.fastgen_cpu.ordered_linear(x, w, b, block, int(bias == "last"))
    assert torch.equal(got, emulate(x, w, b, block, bias == "last"))


@needs_kernels
def test_kernel_rejects_bad_arguments():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="inner dimension"):
        torch.ops.fastgen_cpu.ordered_linear(x, torch.randn(5, 7), None, 4, 0)
    with pytest.raises(RuntimeError, match="block must be positive"):
        torch.ops.fastgen_cpu.ordered_linear(x, w, None, 0, 0)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.fastgen_cpu.ordered_linear(x, w, torch.randn(4), 4, 0)


@pytest.fixture
def calibrate_at_once(monkeypatch):
    """Calibrate each key on its first call, and keep the ordered kernel whenever it is identical (the
    speed test is the calibration's business, not this file's)."""
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
    monkeypatch.setattr(linear, "MIN_OUT_FEATURES", 1)
    monkeypatch.setattr(linear, "TRIAL_CALLS", 0)  # the kept form serves at once (its trial: test_linear.py)

    def prefer_ordered(medians):
        ordered = [name for name in medians if name.startswith("ordered")]
        return ordered[0] if ordered else "linear"

    monkeypatch.setattr(linear, "pick", prefer_ordered)
    linear.forget_choices()
    yield
    linear.forget_choices()


def _same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())


@needs_kernels
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 70),
    k=st.sampled_from([16, 100, 384, 768, 1000]),
    n=st.sampled_from([8, 77, 256, 768]),
    bias=st.booleans(),
    special=st.sampled_from([None, "denormal", "inf", "nan"]),
    transposed=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_exact_linear_with_the_kernel_is_f_linear(calibrate_at_once, rows, k, n, bias, special, transposed, seed):
    """Choices persist across examples on purpose: a key calibrated once serves later inputs."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * 0.05
    b = torch.randn(n, generator=generator) if bias else None
    calibration = torch.randn(rows, k, generator=generator)
    assert torch.equal(linear.exact_linear(calibration, w, b), F.linear(calibration, w, b))
    x = torch.randn(k, rows, generator=generator).t() if transposed else torch.randn(rows, k, generator=generator)
    if special == "denormal":
        x = x * 1e-39
    elif special is not None:
        x[rows // 2, k // 3] = float(special)
    assert _same_bits(linear.exact_linear(x, w, b), F.linear(x, w, b))


@needs_kernels
def test_a_wrong_order_is_never_kept(calibrate_at_once, monkeypatch):
    monkeypatch.setattr(linear, "ORDER_BLOCKS", (5,))  # no BLAS sums 768 products in chains of 5
    x, w, b = torch.randn(16, 768), torch.randn(768, 768), torch.randn(768)
    assert torch.equal(linear.exact_linear(x, w, b), F.linear(x, w, b))
    (choice,) = linear.choices().values()
    assert choice.order is None and "ordered5-bias-first" in choice.not_identical


@needs_kernels
def test_a_zero_bias_does_not_hide_the_bias_place(calibrate_at_once):
    x, w = torch.randn(16, 768), torch.randn(768, 768) * 0.05
    zero = torch.zeros(768)
    assert torch.equal(linear.exact_linear(x, w, zero), F.linear(x, w, zero))
    (choice,) = linear.choices().values()
    bias = torch.randn(768)  # same key: the choice made on the zero bias serves it
    assert torch.equal(linear.exact_linear(x, w, bias), F.linear(x, w, bias))
    if choice.order is not None:  # the probe kept at most the one place F.linear uses
        places = {name.rsplit("-", 1)[1] for name in choice.times_ms if name.startswith(f"ordered{choice.order[0]}-")}
        assert len(places) == 1


def test_the_switch_keeps_the_kernel_out(monkeypatch):
    monkeypatch.setenv(linear.ORDERED_ENV, "0")
    assert linear.ordered_kernel() is None
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
    linear.forget_choices()
    try:
        x, w = torch.randn(16, 768), torch.randn(2048, 768)
        assert torch.equal(linear.exact_linear(x, w), F.linear(x, w))
        assert not any(c.form.startswith("ordered") for c in linear.choices().values())
    finally:
        linear.forget_choices()
