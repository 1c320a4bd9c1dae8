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
