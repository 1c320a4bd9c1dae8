"""Issue 24's defects of continuous batching (items 1, 4, 5 and its listing), each against upstream ``generate``.

1. The default length of an encoder-decoder call: ``generate`` reads ``max_length=20`` as 20 *new* tokens
   (decoder limit 21, capped at ``max_position_embeddings``); explicit ``max_length``, ``max_new_tokens``,
   ``min_length`` and a ``generation_config`` keep their meaning.
4. A compiled forward (``model.forward = torch.compile(model.forward)``, ``model.compile()``) falls back with one
   warning to upstream's result.
5. The per-row position hooks stay inside their call: another thread's ``generate`` (under
   ``fastgen.unpatched()``) and a second ``generate_many`` on the same model see the stock modules.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import fastgen
from fastgen.continuous import generate_many
from tests import harness
from tests.continuous_cases import alone, make_inputs


@pytest.fixture(scope="module")
def plain():
    """Tiny models that rarely emit EOS: most outputs run to the length limit."""
    return {family: harness.tiny_hf_model(family) for family in ("bart", "t5")}


def _same_as_alone(model, inputs, kwargs, results) -> list[int]:
    lengths = []
    for index, (ids, sequences) in enumerate(zip(inputs, results, strict=True)):
        expected = alone(model, ids, kwargs).sequences
        assert torch.equal(sequences, expected), f"input {index}: {sequences.tolist()} != {expected.tolist()}"
        lengths.append(sequences.shape[1])
    return lengths


# ----------------------------------------------------------------------------- item 1: length limits

LENGTH_CASES = {
    "default-greedy": dict(),
    "default-beam2": dict(num_beams=2),
    "max_length-15": dict(num_beams=2, max_length=15),
    "max_new_tokens-9": dict(max_new_tokens=9),
    "min_length-23-default-max": dict(min_length=23),
    "generation_config-max_length-12": dict(generation_config=GenerationConfig(max_length=12, num_beams=2)),
}


@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_length_limits_match_generate_alone(plain, family, case):
    model, kwargs = plain[family], LENGTH_CASES[case]
    inputs = make_inputs(5)
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=4, **kwargs))
    assert "continuous" in rep.ran, rep.fell_back
    lengths = _same_as_alone(model, inputs, kwargs, results)
    if case.startswith("default"):
        assert max(lengths) == 21, lengths  # 20 new tokens after the decoder start token, reached


def test_default_length_is_capped_at_the_position_table():
    """With 16 positions, ``generate``'s default limit is ``min(20 + 1, 16)``; BART forces EOS at its last step."""
    model = harness.tiny_hf_model("bart", max_position_embeddings=16)
    inputs = [ids[:14] for ids in make_inputs(4)]
    results = list(generate_many(model, inputs, batch_rows=4, num_beams=2))
    assert max(_same_as_alone(model, inputs, dict(num_beams=2), results)) == 16
