"""Patched generation on CUDA equals upstream on CUDA (tiny models, fp32). Skipped without a GPU."""

import pytest
import torch

from tests import harness

pytestmark = pytest.mark.gpu

CASES = {
    "beam_no_repeat": dict(max_new_tokens=8, num_beams=4, no_repeat_ngram_size=2),
    "beam_return_2": dict(max_new_tokens=8, num_beams=4, num_return_sequences=2),
    "greedy_no_repeat": dict(max_new_tokens=8, no_repeat_ngram_size=2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2", "llama", "qwen2"])
def test_same_generation_on_cuda(family: str, case: str) -> None:
    assert not torch.backends.cuda.matmul.allow_tf32  # fp32 must mean fp32 (torch's default)
    model = harness.tiny_hf_model(family).to("cuda")
    inputs = {k: v.to("cuda") for k, v in harness.tiny_inputs(model, batch=3).items()}
    harness.assert_same_generation(model, inputs, atol=1e-4, rtol=1e-4, **CASES[case])


@pytest.mark.parametrize("case", ["beam_no_repeat", "greedy_no_repeat"])
def test_decoder_only_inputs_left_on_cpu_with_a_cuda_model(case: str) -> None:
    """Transformers 5.24 lets a decoder-only model's inputs stay on another device (it moves each step's
    model inputs): fastgen's loops then step aside, and the output is upstream's, on upstream's device.
    (Passed on an H200, issue 26.)"""
    model = harness.tiny_hf_model("gpt2").to("cuda")
    inputs = {k: v.cpu() for k, v in harness.tiny_inputs(model, batch=3).items()}
    reference, candidate = harness.assert_same_generation(model, inputs, atol=1e-4, rtol=1e-4, **CASES[case])
    assert candidate.sequences.device == reference.sequences.device


def _outcome(call) -> str:
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {str(error)[:40]}"
    return "ok"


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_calls_upstream_refuses_with_inputs_on_cpu_are_refused_alike(family: str) -> None:
    """Where upstream itself raises (an encoder-decoder's encoder does not move CPU inputs; upstream's
    assisted decoding takes batch 1 only), fastgen steps aside and raises the same error."""
    import fastgen

    model = harness.tiny_hf_model(family).to("cuda")
    inputs = {k: v.cpu() for k, v in harness.tiny_inputs(model, batch=3).items()}
    kwargs = dict(max_new_tokens=4, num_beams=4) if family == "bart" else dict(max_new_tokens=4)
    if family == "gpt2":
        kwargs["assistant_model"] = harness.tiny_hf_model("gpt2").to("cuda")
    with fastgen.unpatched():
        upstream = _outcome(lambda: model.generate(**inputs, **kwargs))
    patched = _outcome(lambda: model.generate(**inputs, **kwargs))
    assert upstream != "ok" and patched == upstream
