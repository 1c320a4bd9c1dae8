"""The exact mode's MKL packed-B candidate (``fastgen_cpu::mkl_packed_linear`` on a weight packed once).

What is asserted: a key keeps MKL's form only where its result was ``torch.equal`` to ``F.linear``'s on the real
input and on a random probe, and every later result of the key equals ``F.linear``'s; a planted difference is
never kept and its copy is given back; only a Parameter (the same object at every call) gets a copy; a write
through ``.data`` reaches the copy at the next call's content check; ``FASTGEN_MKL_PACKED=0`` keeps it out.
"""

import pytest
import torch
import torch.nn.functional as F

from fastgen.ops import cpu_kernels, linear

needs_mkl = pytest.mark.skipif(
    not cpu_kernels.available() or linear.mkl_op() is None, reason="no MKL packed sgemm with fastgen's kernels here"
)


@pytest.fixture
def prefer_mkl(monkeypatch):
    """Calibrate at the first call and keep MKL's form wherever it is identical (speed is not under test)."""
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
    monkeypatch.setattr(linear, "MIN_OUT_FEATURES", 1)
    monkeypatch.setattr(linear, "TRIAL_CALLS", 0)
    monkeypatch.setattr(linear, "pick", lambda medians: "mkl" if "mkl" in medians else "linear")
    linear.forget_choices()
    yield
    linear.forget_choices()


def _parameter(n: int, k: int, seed: int) -> torch.nn.Parameter:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(n, k, generator=generator) * 0.05, requires_grad=False)


@needs_mkl
@pytest.mark.parametrize(("n", "k"), [(256, 256), (1024, 256), (256, 1024), (130, 48)])
@pytest.mark.parametrize("rows", [1, 4, 16, 40, 64])
def test_a_key_on_mkls_form_gives_f_linears_bits(prefer_mkl, n, k, rows):
    w, b = _parameter(n, k, 0), torch.randn(n)
    first = torch.randn(rows, k)
    assert torch.equal(linear.exact_linear(first, w, b), F.linear(first, w, b))
    (choice,) = linear.choices().values()
    assert choice.mkl == (choice.form == "mkl") and (choice.mkl or "mkl" in choice.not_identical)
    for seed in range(3):  # later inputs of the key, whatever form it kept
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(linear.exact_linear(x, w, b), F.linear(x, w, b))
    assert (w in linear._mkl_copies) == choice.mkl  # a copy only where the form serves


@needs_mkl
def test_a_differing_packed_result_is_never_kept(prefer_mkl, monkeypatch):
    real = linear.mkl_op()
    monkeypatch.setattr(linear, "mkl_op", lambda: lambda *args: real(*args) * (1 + 2**-20))
    w, b, x = _parameter(256, 256, 1), torch.randn(256), torch.randn(16, 256)
    assert torch.equal(linear.exact_linear(x, w, b), F.linear(x, w, b))
    (choice,) = linear.choices().values()
    assert not choice.mkl and "mkl" in choice.not_identical
    assert w not in linear._mkl_copies  # given back


@needs_mkl
def test_a_plain_tensor_gets_no_copy(prefer_mkl):
    w, x = torch.randn(256, 256), torch.randn(16, 256)
    assert torch.equal(linear.exact_linear(x, w), F.linear(x, w))
    (choice,) = linear.choices().values()
    assert "mkl" not in choice.times_ms and "mkl" not in choice.not_identical
    assert len(linear._mkl_copies) == 0


@needs_mkl
def test_a_write_through_data_reaches_the_packed_copy(prefer_mkl):
    w, b, x = _parameter(256, 256, 2), torch.randn(256), torch.randn(16, 256)
    linear.exact_linear(x, w, b)
    (choice,) = linear.choices().values()
    if not choice.mkl:
        pytest.skip("MKL's packed form differs from F.linear for this key on this CPU")
    w.data.mul_(-3)  # moves neither the version counter nor the storage
    linear.refresh_mkl_copies([w])  # what each generate call's exact scope does on entry
    assert torch.equal(linear.exact_linear(x, w, b), F.linear(x, w, b))


def test_the_switch_keeps_mkl_out(prefer_mkl, monkeypatch):
    monkeypatch.setenv(linear.MKL_ENV, "0")
    assert linear.mkl_op() is None
    w, x = _parameter(256, 256, 3), torch.randn(16, 256)
    assert torch.equal(linear.exact_linear(x, w), F.linear(x, w))
    assert not any("mkl" in c.times_ms for c in linear.choices().values())
