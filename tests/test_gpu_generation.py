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
@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_inputs_left_on_cpu_with_a_cuda_model(family: str, case: str) -> None:
    """Transformers 5.24 lets the inputs stay on another device (it moves each step's model inputs):
    fastgen's loops then step aside, and the output is upstream's, on upstream's device."""
    model = harness.tiny_hf_model(family).to("cuda")
    inputs = harness.tiny_inputs(model, batch=3)
    inputs = {k: v.cpu() for k, v in inputs.items()}
    reference, candidate = harness.assert_same_generation(model, inputs, atol=1e-4, rtol=1e-4, **CASES[case])
    assert candidate.sequences.device == reference.sequences.device


def test_batched_assisted_decoding_with_inputs_on_cpu() -> None:
    model = harness.tiny_hf_model("gpt2").to("cuda")
    draft = harness.tiny_hf_model("gpt2").to("cuda")
    inputs = {k: v.cpu() for k, v in harness.tiny_inputs(model, batch=3).items()}
    harness.assert_same_generation(
        model, inputs, atol=1e-4, rtol=1e-4, max_new_tokens=8, assistant_model=draft, output_scores=False
    )
