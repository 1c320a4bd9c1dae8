"""Continuous batching (``fastgen.generate_many``, issue 19) against ``generate`` on each input alone.

The oracle is upstream (``fastgen.unpatched()``) ``generate`` on one unpadded input. Tokens must be
equal. Scores are compared with a tolerance of a few ulps: CPU GEMMs round differently for different
row counts (a linear layer over 1 row and over 4 copies of it differ in the last bit; checked in
``test_gemm_row_count_changes_bits``), so no batched decoder, upstream's static batches included,
can match the single-input run bit for bit. The tiny T5s amplify those last bits more (see
:data:`SCORE_ATOL`).

The tiny models get an EOS gain so that inputs finish at very different steps (asserted), and the
batch is small, so inputs leave and newcomers join throughout the run.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import transformers

import fastgen
from fastgen.continuous import generate_many
from fastgen.continuous import model as model_calls
from fastgen.continuous.scheduler import run_continuous
from fastgen.continuous.settings import FAMILIES as SERVED_FAMILIES
from fastgen.continuous.settings import resolve
from fastgen.ops import fast_linear
from tests import continuous_cases, harness
from tests.continuous_cases import alone, make_inputs
from tests.harness import requires_feature

FAMILIES = SERVED_FAMILIES
#: EOS gain per family: inputs then end anywhere between 1 and the length limit
EOS_GAIN = {
    "bart": 2.0,
    "mbart": 2.0,
    "marian": 1.5,
    "pegasus": 1.5,
    "m2m_100": 3.0,
    "t5": 3.0,
    "mt5": 2.0,
    "umt5": 2.0,
}
#: Absolute tolerance of ``sequences_scores`` (1e-5 otherwise: a few ulps of the BART-likes' logits, near 2).
#: The tiny T5s' logits reach 150-300 (their ``initializer_factor=3``, without which they repeat one
#: token) and their layers amplify last-bit GEMM differences up to 1e-2 of a score: upstream's own
#: padded batch moves them as much (``test_upstream_batches_move_tiny_t5_scores``).
SCORE_ATOL = {"t5": 1e-2, "mt5": 1e-2, "umt5": 1e-2}
#: one family per way of giving rows their own positions (families.ADAPTERS): learned table, table read
#: from the token ids, relative bias shared from the first layer, relative bias in every layer
POSITION_KINDS = ("bart", "m2m_100", "t5", "umt5")
CASES = {
    "greedy": dict(num_beams=1, max_new_tokens=24),
    "greedy-ngram-min": dict(num_beams=1, max_new_tokens=20, no_repeat_ngram_size=2, min_new_tokens=3),
    "beam4": dict(num_beams=4, max_new_tokens=24),
    "beam3-ret2-lp0.7-ngram": dict(
        num_beams=3, num_return_sequences=2, length_penalty=0.7, no_repeat_ngram_size=2, max_new_tokens=20
    ),
    "beam4-never-lp-neg": dict(num_beams=4, early_stopping="never", length_penalty=-0.5, max_new_tokens=20),
    "beam4-early-true": dict(num_beams=4, early_stopping=True, max_new_tokens=20),
    "beam2-min-new-forced-bos": dict(num_beams=2, min_new_tokens=4, forced_bos_token_id=7, max_length=18),
}


def eos_model(family: str):
    return continuous_cases.eos_model(family, EOS_GAIN[family])


@pytest.fixture(scope="module")
def models():
    return {family: eos_model(family) for family in FAMILIES}


def assert_matches_alone(model, inputs, kwargs, results) -> list[int]:
    """Tokens equal, scores within :data:`SCORE_ATOL`; returns each input's output length."""
    lengths = []
    for index, (ids, (sequences, scores)) in enumerate(zip(inputs, results, strict=True)):
        ref = alone(model, ids, kwargs)
        assert torch.equal(sequences, ref.sequences), f"input {index}: {sequences.tolist()} != {ref.sequences.tolist()}"
        if kwargs.get("num_beams", 1) > 1:
            atol = SCORE_ATOL.get(model.config.model_type, 1e-5)
            torch.testing.assert_close(scores, ref.sequences_scores, rtol=1e-5, atol=atol)
        lengths.append(sequences.shape[1])
    return lengths


#: cases every family runs in CI. The whole CASES mix runs in CI on POSITION_KINDS, one family per adapter's
#: way of positioning rows; mBART, Marian, Pegasus (BART's adapter) and mT5 (T5's) run these two there, their
#: other cells are marked slow (~14 s in all): the scheduler and the cache are the same for every family
#: (fastgen/continuous/families.py).
CASES_FOR_EVERY_FAMILY = ("greedy", "beam3-ret2-lp0.7-ngram")


@pytest.mark.parametrize(
    "family, case",
    harness.family_case_grid(FAMILIES, CASES, lambda f, c: f in POSITION_KINDS or c in CASES_FOR_EVERY_FAMILY),
)
def test_matches_generate_alone(models, family, case):
    model, kwargs = models[family], CASES[case]
    inputs = make_inputs()
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=3 * kwargs["num_beams"], return_scores=True, **kwargs))
    assert "continuous" in rep.ran, rep.fell_back
    lengths = assert_matches_alone(model, inputs, kwargs, results)
    assert max(lengths) >= 2 * min(lengths), f"inputs should finish at very different steps: {lengths}"


@pytest.mark.parametrize("family", ["bart", "m2m_100", "t5"])
def test_shared_and_per_beam_cross_kv_agree(models, family):
    """With fastgen's grouped attention (one cross K/V row per input) and without it."""
    model, kwargs = models[family], CASES["beam4"]
    inputs = make_inputs(8, seed=3)
    settings, reason = resolve(model, kwargs)
    assert reason is None
    for share in (True, False):
        results = [(r.sequences, r.scores) for r in run_continuous(model, inputs, settings, 8, share=share)]
        assert_matches_alone(model, inputs, kwargs, results)


def test_batch_is_refilled(models):
    """Newcomers join while others run: more rows per step than one input has, fewer steps than one by one."""
    model, kwargs = models["bart"], CASES["beam4"]
    inputs = make_inputs(12, seed=2)
    settings, _ = resolve(model, kwargs)
    stats: dict[str, int] = {}
    list(run_continuous(model, inputs, settings, batch_rows=16, stats=stats))
    alone_steps = sum(alone(model, ids, kwargs).sequences.shape[1] - 1 for ids in inputs)
    assert stats["rows"] / stats["steps"] > 3 * kwargs["num_beams"] - 1, stats
    assert stats["steps"] < alone_steps / 3, (stats, alone_steps)


def test_results_in_input_order_stream(models):
    """Results stream lazily and in input order even though short inputs finish first."""
    model, kwargs = models["marian"], CASES["greedy"]
    inputs = make_inputs(6, seed=5)
    stream = generate_many(model, inputs, batch_rows=3, **kwargs)
    first = next(stream)
    assert torch.equal(first, alone(model, inputs[0], kwargs).sequences)
    assert len(list(stream)) == 5


@pytest.mark.parametrize("family", POSITION_KINDS)
def test_planted_bug_is_caught(models, monkeypatch, family):
    """Without per-row positions (every row at the cache width, as the stock modules do) outputs change.

    Only newcomers that join at another step than the rows running are at other positions, and the tiny
    T5s' tokens depend little on the relative bias, so a few of 12 inputs change for them (every bias
    value is compared in ``test_relative_bias_per_row``)."""
    model, kwargs = models[family], CASES["greedy"]
    inputs = make_inputs(12, seed=8)
    settings, _ = resolve(model, kwargs)

    monkeypatch.setenv("FASTGEN_LEAN_STEP", "0")  # the forward's path (the lean step's: tests/test_continuous_lean.py)
    monkeypatch.setattr(model_calls, "row_positions", lambda model, positions: model)  # the stock modules
    results = [r.sequences for r in run_continuous(model, inputs, settings, batch_rows=3)]
    wrong = [i for i, ids in enumerate(inputs) if not torch.equal(results[i], alone(model, ids, kwargs).sequences)]
    assert wrong, "the comparison should see wrong positions"


def test_m2m_100_positions_per_row(models):
    """Each row's position embedding is the stock module's on that row alone at its own cache length
    (a pad token gets the zero row there, whatever its position)."""
    model = models["m2m_100"]
    module = model.get_decoder().embed_positions
    ids = torch.tensor([[5], [harness.PAD], [7], [9]])
    positions = torch.tensor([0, 3, 9, 4])
    rows = model_calls.row_positions(model, [positions]).get_decoder().embed_positions(ids, None, int(positions.max()))
    for row, position in enumerate(positions.tolist()):
        assert torch.equal(rows[row : row + 1], module(ids[row : row + 1], None, position)), row


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_relative_bias_per_row(models, family):
    """Each row's self-attention bias is the stock bias of that row alone (query at its position, keys up to
    it), in every layer that computes one; the slots past it are masked and not compared."""
    model = models[family]
    positions = torch.tensor([0, 3, 9, 4, 30])
    width = int(positions.max()) + 1
    modules = [
        b.layer[0].SelfAttention
        for b in model.get_decoder().block
        if b.layer[0].SelfAttention.has_relative_attention_bias
    ]
    assert len(modules) == (1 if family == "t5" else len(model.get_decoder().block))
    private = model_calls.row_positions(model, [positions])
    copies = [b.layer[0].SelfAttention for b in private.get_decoder().block]
    for module, copy in zip(modules, [c for c in copies if c.has_relative_attention_bias], strict=True):
        assert copy is not module
        bias = copy.compute_bias(1, width, past_seen_tokens=width - 1)
        assert bias.shape == (len(positions), module.n_heads, 1, width)
        for row, position in enumerate(positions.tolist()):
            alone_bias = module.compute_bias(1, position + 1, past_seen_tokens=position)
            assert torch.equal(bias[row : row + 1, :, :, : position + 1], alone_bias), row
    assert all("compute_bias" not in module.__dict__ for module in modules), "the user's modules are untouched"


@requires_feature("gemm")
@requires_feature("fast_gemm")
def test_generate_s_gemm_scopes_run_in_continuous_batching(models):
    """``gemm`` and the opt-in ``fast_gemm`` and ``int8`` hook ``generate``, which continuous batching does not
    call: the scheduler enters their scopes itself. gemm keeps the tokens (its form gives F.linear's bits)."""
    model, inputs, kwargs = models["bart"], make_inputs(6), dict(num_beams=2, max_new_tokens=12)
    packs = fast_linear.unavailable() is None  # else fast_gemm falls back to upstream's linears
    runs = {}
    base = ["continuous", "dedup"]
    for features in (base, [*base, "gemm"], [*base, "fast_gemm"], [*base, "int8"]):
        with fastgen.patched(features), fastgen.report() as report:
            runs[features[-1]] = list(generate_many(model, inputs, batch_rows=4, **kwargs))
        assert ("gemm" in report.ran) == ("gemm" in features), (features, str(report))
        assert ("fast_gemm" in report.ran) == ("fast_gemm" in features and packs), (features, str(report))
        assert ("int8" in report.ran) == ("int8" in features), (features, str(report))
    assert all(torch.equal(a, b) for a, b in zip(runs["dedup"], runs["gemm"], strict=True))
    assert all("forward" not in module.__dict__ for module in model.modules()), "every module's own forward is back"


def test_gemm_row_count_changes_bits():
    """Why scores get a tolerance: the same row through a linear layer alone and in a batch of 4."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 32)
    differs = 0
    for length in range(1, 12):
        x = torch.randn(1, length, 32)
        differs += not torch.equal(linear(x).expand(4, -1, -1), linear(x.expand(4, -1, -1).contiguous()))
    if differs == 0:
        pytest.skip("this CPU's GEMM happens to be row-count invariant")


def test_upstream_batches_move_tiny_t5_scores(models):
    """Why the T5s' scores get a wider tolerance: upstream ``generate`` on a padded batch of two inputs (no
    fastgen) moves a tiny UMT5's beam score by more than bart's 1e-5, with the same tokens."""
    model, kwargs = models["umt5"], CASES["beam3-ret2-lp0.7-ngram"]
    inputs = make_inputs()[3:5]
    batch = torch.full((2, max(len(ids) for ids in inputs)), harness.PAD)
    mask = torch.zeros_like(batch)
    for row, ids in enumerate(inputs):
        batch[row, : len(ids)], mask[row, : len(ids)] = ids, 1
    with fastgen.unpatched(), torch.inference_mode():
        out = model.generate(
            input_ids=batch, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **kwargs
        )
    ref = alone(model, inputs[0], kwargs)
    assert torch.equal(out.sequences[:2, : ref.sequences.shape[1]], ref.sequences)
    moved = float((out.sequences_scores[:2] - ref.sequences_scores).abs().max())
    if moved == 0:
        pytest.skip("this CPU's GEMM happens to be row-count invariant")
    assert 1e-5 < moved < SCORE_ATOL["umt5"], moved


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(do_sample=True, num_beams=2, max_new_tokens=5), "beam sampling"),
        (dict(num_beams=2, repetition_penalty=1.3, max_new_tokens=5), "repetition_penalty"),
    ],
)
def test_unsupported_arguments_fall_back_with_one_warning(models, caplog, kwargs, reason):
    model = models["bart"]
    inputs = make_inputs(5, seed=6)
    fastgen.optimizer.registry._state.warned.clear()
    with caplog.at_level(logging.WARNING, logger="fastgen"), fastgen.report() as rep:
        torch.manual_seed(0)
        results = list(generate_many(model, inputs, batch_rows=4, **kwargs))
    assert any(f == "continuous" and reason in why for f, why in rep.fell_back), rep.fell_back
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1
    assert len(results) == len(inputs) and all(r.dim() == 2 for r in results)


def test_unsupported_family_falls_back_to_generate_alone():
    """An encoder-decoder family without an adapter (BlenderbotSmall: BART-like, but not proven here)."""
    config = transformers.BlenderbotSmallConfig(**harness.HF_FAMILIES["bart"][2])
    torch.manual_seed(0)
    model = transformers.BlenderbotSmallForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = harness.PAD
    inputs = make_inputs(5, seed=7)
    kwargs = dict(num_beams=2, max_new_tokens=6)
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=4, **kwargs))
    assert any(f == "continuous" and "blenderbot-small" in why for f, why in rep.fell_back)
    for ids, result in zip(inputs, results, strict=True):  # each input alone (issue 24: was a padded batch's rows)
        assert torch.equal(result, alone(model, ids, kwargs).sequences)


def test_bad_input_is_a_clear_error(models):
    model = models["bart"]
    with pytest.raises(ValueError, match="input 1: expected a non-empty 1-D"):
        list(generate_many(model, [[5, 6], []], num_beams=2, max_new_tokens=4))
    with pytest.raises(ValueError, match="batch_rows"):
        generate_many(model, [[5, 6]], batch_rows=0)


def test_readme_lists_the_served_families():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    match = re.search(r"<!-- families:continuous -->(.*?)<!-- /families -->", readme)
    assert match, "README has no continuous-batching family list"
    assert {name.strip() for name in match.group(1).split(",")} == set(SERVED_FAMILIES)
