"""What the continuous-batching tests share: inputs of very different lengths, models whose outputs end at
different steps, and the oracle (upstream ``generate`` on one unpadded input)."""

from __future__ import annotations

import torch

import fastgen
from tests import harness


def eos_model(family: str, gain: float, head_scale: float = 1.0, attention: str | None = None):
    """A tiny model of ``family`` whose LM head's EOS row is scaled by ``gain`` (after the whole head by
    ``head_scale``): the EOS logit then follows the input, so inputs end at very different steps."""
    model = harness.tiny_hf_model(family)
    if attention is not None:
        model.set_attn_implementation(attention)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
        model.get_output_embeddings().weight[harness.EOS] *= gain
    return model


def make_inputs(count: int = 10, seed: int = 1) -> list[torch.Tensor]:
    """``count`` inputs of 2 to 39 random tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, harness.VOCAB, (n,), generator=generator) for n in lengths]


def alone(model, ids: torch.Tensor, kwargs: dict):
    """The oracle: upstream ``generate`` on ``ids`` alone (no padding), with its scores."""
    with fastgen.unpatched(), torch.inference_mode():
        return model.generate(
            input_ids=ids[None],
            attention_mask=torch.ones_like(ids[None]),
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
