"""Sampling in continuous batching (``generate_many(..., do_sample=True, seed=S)``, issue 19).

The definition under test (``generate_many``'s docstring): input ``i`` is sampled from its own stream,
so its result equals ``torch.manual_seed(S + i); model.generate(input_ids=ids_i[None], do_sample=True,
...)`` with upstream's code (``fastgen.unpatched()``) on that input alone. Tokens must be equal.

As in ``test_continuous_batching.py`` the tiny models get an EOS gain, so inputs finish at very
different steps (asserted), and the batch is small, so inputs leave and newcomers join throughout.
The runs are checked to be non-vacuous (other seeds and greedy give other tokens, the samples of one
input differ), and a stream shared across inputs, the bug this design exists to avoid, is caught.
"""

from __future__ import annotations

import logging

import pytest
import torch

import fastgen
from fastgen.continuous import generate_many
from fastgen.continuous.scheduler import run_continuous
from fastgen.continuous.search import SearchState
from fastgen.continuous.settings import FAMILIES, resolve
from tests import continuous_cases, harness
from tests.continuous_cases import make_inputs
from tests.test_continuous_batching import POSITION_KINDS

#: EOS gain per family (as the greedy/beam tests): samples end anywhere between 1 and the length limit
EOS_GAIN = {
    "bart": 3.0,
    "mbart": 3.0,
    "marian": 2.0,
    "pegasus": 2.0,
    "m2m_100": 3.0,
    "t5": 3.0,
    "mt5": 2.0,
    "umt5": 2.0,
}
#: the tiny T5s' logits reach 150-300, so their samples would all be the argmax: their heads are cooled first
HEAD_SCALE = {"t5": 0.02, "mt5": 0.02, "umt5": 0.02}
SEED = 11
CASES = {
    "plain": dict(max_new_tokens=24),  # upstream's default top_k=50 applies
    "temp0.7-topk10-ret3": dict(temperature=0.7, top_k=10, num_return_sequences=3, max_new_tokens=20),
    "topp0.9-topk20-min-new-ret3": dict(
        top_p=0.9, top_k=20, min_new_tokens=3, num_return_sequences=3, max_new_tokens=20
    ),
    "temp1.5-minp-nok-ngram-maxlen-bos": dict(
        temperature=1.5, min_p=0.05, top_k=0, no_repeat_ngram_size=2, max_length=16, forced_bos_token_id=7, min_length=4
    ),
}


def eos_model(family: str):
    return continuous_cases.eos_model(family, EOS_GAIN[family], HEAD_SCALE.get(family, 1.0))


@pytest.fixture(scope="module")
def models():
    return {family: eos_model(family) for family in FAMILIES}


def alone(model, ids: torch.Tensor, seed: int, kwargs: dict) -> torch.Tensor:
    """The oracle: upstream generate on this input alone, after seeding the global generator."""
    with fastgen.unpatched(), torch.inference_mode():
        torch.manual_seed(seed)
        return model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=True, **kwargs)


def sample_many(model, inputs, kwargs, batch_inputs: int = 3, **extra) -> list[torch.Tensor]:
    rows = batch_inputs * kwargs.get("num_return_sequences", 1)
    return list(generate_many(model, inputs, batch_rows=rows, do_sample=True, **kwargs, **extra))


def mismatches(model, inputs, results, seeds, kwargs) -> list[int]:
    return [i for i, ids in enumerate(inputs) if not torch.equal(results[i], alone(model, ids, seeds[i], kwargs))]


#: as in tests/test_continuous_batching.py: every case in CI on one family per position adapter (POSITION_KINDS);
#: the same-adapter families (mBART, Marian, Pegasus, mT5) run these two in CI, their other cells are slow.
CASES_FOR_EVERY_FAMILY = ("plain", "temp0.7-topk10-ret3")


@pytest.mark.parametrize(
    "family, case",
    harness.family_case_grid(FAMILIES, CASES, lambda f, c: f in POSITION_KINDS or c in CASES_FOR_EVERY_FAMILY),
)
def test_each_input_equals_generate_alone_with_its_seed(models, family, case):
    model, kwargs = models[family], CASES[case]
    inputs = make_inputs()
    with fastgen.report() as rep:
        results = sample_many(model, inputs, kwargs, seed=SEED)
    assert "continuous" in rep.ran, rep.fell_back
    assert mismatches(model, inputs, results, [SEED + i for i in range(len(inputs))], kwargs) == []
    returns = kwargs.get("num_return_sequences", 1)
    assert all(r.shape[0] == returns for r in results)
    ends = [generated(row) for r in results for row in r]
    assert max(ends) >= 2 * min(ends), f"samples should finish at very different steps: {ends}"
    assert len({r.shape[1] for r in results}) > 1, "inputs should leave at different steps"
    if returns > 1:  # the rows of one input are different samples
        assert any(len({tuple(row.tolist()) for row in r}) == returns for r in results)


def generated(row: torch.Tensor) -> int:
    """Tokens a sample generated: up to its first EOS after the decoder start, else all of them."""
    eos = (row[1:] == harness.EOS).nonzero().flatten()
    return int(eos[0]) + 1 if eos.numel() else row.numel() - 1


def test_runs_are_not_vacuous(models):
    """Another seed changes the samples, and sampling is not greedy search on these models."""
    model, kwargs = models["bart"], CASES["temp0.7-topk10-ret3"]
    inputs = make_inputs(6, seed=2)
    first = sample_many(model, inputs, kwargs, seed=SEED)
    again = sample_many(model, inputs, kwargs, seed=SEED)
    other = sample_many(model, inputs, kwargs, seed=SEED + 100)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert sum(not torch.equal(a, b) for a, b in zip(first, other, strict=True)) >= 4
    greedy = list(generate_many(model, inputs, batch_rows=3, max_new_tokens=20))
    assert all(not torch.equal(s[:1], g) for s, g in zip(first, greedy, strict=True))


def test_shared_stream_is_caught(models, monkeypatch):
    """Planted bug: every input draws from one generator (as one global stream would): outputs change."""
    model, kwargs = models["marian"], CASES["plain"]
    inputs = make_inputs(8, seed=4)
    original = SearchState.add

    def add_sharing_one_stream(self, indices, seeds=None):
        original(self, indices, seeds)
        self.generators = [self.generators[0]] * len(self.generators)

    monkeypatch.setattr(SearchState, "add", add_sharing_one_stream)
    results = sample_many(model, inputs, kwargs, seed=SEED)
    assert mismatches(model, inputs, results, [SEED + i for i in range(len(inputs))], kwargs), "should be caught"


@pytest.mark.parametrize("share", [True, False])
def test_shared_and_per_row_cross_kv_agree(models, share):
    """Three samples per input over one cross K/V row per input (grouped attention) and over three."""
    model, kwargs = models["pegasus"], CASES["temp0.7-topk10-ret3"]
    inputs = make_inputs(7, seed=3)
    settings, reason = resolve(model, dict(do_sample=True, **kwargs))
    assert reason is None and settings.rows_per_input == 3
    seeds = [100 + 7 * i for i in range(len(inputs))]
    finished = run_continuous(model, inputs, settings, batch_rows=6, share=share, seeds=seeds)
    results = [item.sequences for item in finished]
    assert mismatches(model, inputs, results, seeds, kwargs) == []


def test_without_seed_one_draw_from_the_global_generator(models):
    """No seed: S is drawn once from torch's global generator, so torch.manual_seed makes the run reproducible."""
    model, kwargs = models["mbart"], CASES["plain"]
    inputs = make_inputs(5, seed=5)
    torch.manual_seed(3)
    first = sample_many(model, inputs, kwargs)
    torch.manual_seed(3)
    drawn = int(torch.randint(0, 2**62, ()).item())
    assert mismatches(model, inputs, first, [drawn + i for i in range(len(inputs))], kwargs) == []
    torch.manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(first, sample_many(model, inputs, kwargs), strict=True))


def test_one_seed_per_input(models):
    """An iterable gives each input its seed (what the CLI passes: the line's number); too few is an error."""
    model, kwargs = models["bart"], CASES["plain"]
    inputs = make_inputs(5, seed=6)
    seeds = [40, 3, 17, 3, 99]
    assert mismatches(model, inputs, sample_many(model, inputs, kwargs, seed=iter(seeds)), seeds, kwargs) == []
    with pytest.raises(ValueError, match="input 2: no seed left"):
        sample_many(model, inputs, kwargs, seed=[1, 2])


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(num_beams=2, max_new_tokens=6), "beam sampling"),
        (dict(typical_p=0.9, max_new_tokens=6), "typical_p"),
    ],
)
def test_unserved_sampling_falls_back_keeping_the_seeds(models, caplog, kwargs, reason):
    """Beam sampling and other warpers fall back with one warning; with a seed, still one stream per input."""
    model = models["bart"]
    inputs = make_inputs(4, seed=7)
    fastgen.optimizer.registry._state.warned.clear()
    with caplog.at_level(logging.WARNING, logger="fastgen"), fastgen.report() as rep:
        state = torch.get_rng_state()
        results = sample_many(model, inputs, kwargs, seed=SEED)
        assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is left alone
    assert any(f == "continuous" and reason in why for f, why in rep.fell_back), rep.fell_back
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1
    assert mismatches(model, inputs, results, [SEED + i for i in range(len(inputs))], kwargs) == []
