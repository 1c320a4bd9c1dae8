"""``fastgen_cpu::topk_distinct`` behind :func:`fastgen.ops.beam_topk.top_k`: torch.topk's result, bit for bit.

What is asserted: on rows with and without ties, -inf, NaN and few finite values, ``top_k`` returns
exactly ``torch.topk``'s values and indices; the raw op flags exactly the rows whose best k + 1 values
are not strictly decreasing (those go back to torch.topk); ``top_k`` never builds the kernels itself.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.ops import beam_topk, cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=str(cpu_kernels.unavailable_reason()))


def _rows(rows, length, seed, ties, specials):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, length, generator=generator) * 5
    if ties:  # a coarse grid: many equal values, some among the best
        scores = (scores * 2).round() / 2
    if specials:
        picks = torch.randint(0, length, (rows, 3), generator=generator)
        scores.scatter_(1, picks[:, :1], float("-inf"))
        scores.scatter_(1, picks[:, 1:2], float("inf"))
        if specials == "nan":
            scores.scatter_(1, picks[:, 2:], float("nan"))
    return scores


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 5),
    length=st.integers(2, 700),
    k=st.integers(1, 20),
    seed=st.integers(0, 10**6),
    ties=st.booleans(),
    specials=st.sampled_from([None, "inf", "nan"]),
)
def test_top_k_is_torch_topk_bit_for_bit(rows, length, k, seed, ties, specials):
    scores = _rows(rows, length, seed, ties, specials)
    k = min(k, length - 1)
    values, indices = beam_topk.top_k(scores.clone(), k)
    expected_values, expected_indices = torch.topk(scores, k)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(values.isnan(), expected_values.isnan())
    assert torch.equal(values.nan_to_num(), expected_values.nan_to_num())


@needs_kernels
def test_rows_with_ties_or_too_few_finite_values_are_flagged():
    scores = torch.tensor(
        [
            [0.1, 0.9, 0.5, 0.3, 0.7],  # distinct: served
            [0.1, 0.9, 0.9, 0.3, 0.7],  # a tie among the best
            [0.1, 0.9, 0.5, 0.7, 0.7],  # a tie at the boundary (k-th and (k+1)-th)
            [0.1, 0.9, 0.5, 0.1, 0.7],  # a tie below the boundary: irrelevant
            [float("-inf")] * 3 + [0.2, 0.1],  # -inf among the best k + 1
        ]
    )
    values, indices, distinct = torch.ops.fastgen_cpu.topk_distinct(scores, 3)
    assert distinct.tolist() == [True, False, False, True, False]
    expected_values, expected_indices = torch.topk(scores, 3)
    for row in (0, 3):
        assert torch.equal(values[row], expected_values[row]) and torch.equal(indices[row], expected_indices[row])


def test_top_k_does_not_build_the_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})  # as in a process where no fast mode ran
    calls = []
    monkeypatch.setattr(cpu_kernels, "_load", lambda: calls.append(1))
    scores = torch.randn(2, 50)
    _, indices = beam_topk.top_k(scores, 4)
    assert calls == [] and torch.equal(indices, torch.topk(scores, 4).indices)


@needs_kernels
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2"])
def test_the_default_mode_with_the_kernel_loaded_changes_no_bit(family, monkeypatch):
    import fastgen
    from tests import harness

    calls = []
    real = beam_topk.top_k

    def counted(scores, k):
        calls.append(cpu_kernels.loaded())
        return real(scores, k)

    monkeypatch.setattr(beam_topk, "top_k", counted)
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=3)
    kwargs = dict(num_beams=4, max_new_tokens=8, no_repeat_ngram_size=2, return_dict_in_generate=True,
                  output_scores=True)  # fmt: skip
    with fastgen.unpatched():
        upstream = model.generate(**inputs, **kwargs)
    monkeypatch.setenv("FASTGEN_CPU_KERNELS", "0")
    without = fastgen_generate(model, inputs, kwargs)
    assert calls and not any(calls)
    monkeypatch.delenv("FASTGEN_CPU_KERNELS")
    calls.clear()
    patched = fastgen_generate(model, inputs, kwargs)
    assert calls and all(calls)  # the default mode took its top-k through the loaded kernel
    assert torch.equal(upstream.sequences, patched.sequences)
    # bit for bit what the default mode gives without the kernel (whose scores are upstream's to ~1 ulp:
    # dedup's grouped SDPA rounds differently, docs/how-it-works/dedup.md)
    assert torch.equal(without.sequences_scores, patched.sequences_scores)
    assert all(torch.equal(a, b) for a, b in zip(without.scores, patched.scores, strict=True))


def fastgen_generate(model, inputs, kwargs):
    import fastgen

    with fastgen.patched():
        return model.generate(**inputs, **kwargs)


@needs_kernels
def test_large_k_goes_to_torch_topk(monkeypatch):
    """The kernel's sorted list loses to torch.topk at large k (and on sorted rows): it serves k <= KERNEL_MAX_K."""
    calls = []
    kernel = torch.ops.fastgen_cpu.topk_distinct
    monkeypatch.setattr(torch.ops.fastgen_cpu, "topk_distinct", lambda x, k: calls.append(k) or kernel(x, k))
    scores = torch.randn(3, 5000)
    for k in (beam_topk.KERNEL_MAX_K, beam_topk.KERNEL_MAX_K + 1, 1024):
        values, indices = beam_topk.top_k(scores, k)
        expected_values, expected_indices = torch.topk(scores, k)
        assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)
    assert calls == [beam_topk.KERNEL_MAX_K]
