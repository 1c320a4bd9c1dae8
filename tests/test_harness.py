"""The harness itself: every tiny model generates, and patched == unpatched in every mode."""

import pytest
import torch

from tests import harness
from tests.conftest import HAS_FAIRSEQ

MODES = {
    "greedy": dict(max_new_tokens=8, do_sample=False),
    "beam": dict(max_new_tokens=8, num_beams=3, do_sample=False),
    "sample": dict(max_new_tokens=8, do_sample=True, top_k=20),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_assert_same_generation_every_family(hf_model, mode):
    inputs = harness.tiny_inputs(hf_model, batch=2, length=10)
    ref, _out = harness.assert_same_generation(hf_model, inputs, **MODES[mode])
    assert ref.sequences.shape[0] == 2
    assert ref.sequences.shape[1] > (1 if hf_model.config.is_encoder_decoder else inputs["input_ids"].shape[1])


def test_assert_same_generation_detects_a_difference(monkeypatch):
    """The oracle must fail when patched generation differs (guards against a vacuous harness)."""
    model = harness.tiny_hf_model("bart")
    inputs = harness.tiny_inputs(model)
    calls = {"n": 0}
    original = type(model).generate

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # second call is the patched run: ask for one token fewer
            kwargs["max_new_tokens"] -= 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", generate)
    with pytest.raises(AssertionError):
        harness.assert_same_generation(model, inputs, max_new_tokens=6)


def test_sampling_is_seeded():
    model = harness.tiny_hf_model("gpt2")
    inputs = harness.tiny_inputs(model)
    a, _ = harness.assert_same_generation(model, inputs, seed=3, max_new_tokens=10, do_sample=True)
    b, _ = harness.assert_same_generation(model, inputs, seed=4, max_new_tokens=10, do_sample=True)
    assert not torch.equal(a.sequences, b.sequences)


def test_padding_follows_model_kind():
    enc_dec = harness.tiny_inputs(harness.tiny_hf_model("t5"), batch=3)
    dec = harness.tiny_inputs(harness.tiny_hf_model("llama"), batch=3)
    assert enc_dec["attention_mask"][2, -1] == 0 and enc_dec["attention_mask"][2, 0] == 1
    assert dec["attention_mask"][2, 0] == 0 and dec["attention_mask"][2, -1] == 1


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
@pytest.mark.parametrize("beam", [1, 4])
def test_fairseq_transformer_generates(fairseq_transformer, beam):
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary)
    ref, _ = harness.assert_same_fairseq_generation(model, dictionary, sample, beam_size=beam, max_len_b=8)
    assert len(ref) == 3 and all(len(hypos) == beam for hypos in ref)
