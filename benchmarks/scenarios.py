"""Benchmark scenarios: real model shapes with random weights, the seeds' generation settings.

Random weights are enough for speed: the work per step depends on shapes, and equal work is
forced with ``min_new_tokens == max_new_tokens`` (every hypothesis runs the full length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    batch: int
    input_len: int
    new_tokens: int
    generate: dict[str, Any]
    #: overrides of batch / input_len / new_tokens on a GPU
    cuda: dict[str, Any] = dataclasses.field(default_factory=dict)
    gpu_only: bool = False
    note: str = ""

    def settings(self, device: str) -> dict[str, Any]:
        base = {"batch": self.batch, "input_len": self.input_len, "new_tokens": self.new_tokens}
        return base | (self.cuda if device == "cuda" else {})

    def build_model(self, device: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
        config = getattr(transformers, self.config_class)(**self.config)
        torch.manual_seed(0)
        model = getattr(transformers, self.model_class)(config)
        return model.to(device=device, dtype=dtype).eval()

    def inputs(self, model: transformers.PreTrainedModel, batch: int, input_len: int) -> dict[str, torch.Tensor]:
        """Random ids, the last row shorter by a quarter (padding exercised, on the side HF expects)."""
        generator = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        ids = torch.randint(4, vocab, (batch, input_len), generator=generator)
        mask = torch.ones_like(ids)
        if batch > 1:
            short = input_len // 4
            if model.config.is_encoder_decoder:
                mask[-1, input_len - short :] = 0
            else:
                mask[-1, :short] = 0
        ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
        device = model.device
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


_BART = dict(
    vocab_size=50265,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=2,
    max_position_embeddings=1024,
)
_SUMMARY = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, early_stopping=True)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "bart-base",
            "BartConfig",
            "BartForConditionalGeneration",
            dict(
                _BART,
                d_model=768,
                encoder_layers=6,
                decoder_layers=6,
                encoder_attention_heads=12,
                decoder_attention_heads=12,
                encoder_ffn_dim=3072,
                decoder_ffn_dim=3072,
            ),
            batch=4,
            input_len=256,
            new_tokens=32,
            generate=_SUMMARY,
            cuda=dict(batch=32, input_len=1024, new_tokens=140),
            note="CNN/DM-like summarisation: beam 4, no-repeat 3",
        ),
        Scenario(
            "bart-large",
            "BartConfig",
            "BartForConditionalGeneration",
            dict(
                _BART,
                d_model=1024,
                encoder_layers=12,
                decoder_layers=12,
                encoder_attention_heads=16,
                decoder_attention_heads=16,
                encoder_ffn_dim=4096,
                decoder_ffn_dim=4096,
            ),
            batch=2,
            input_len=512,
            new_tokens=16,
            generate=_SUMMARY,
            cuda=dict(batch=32, input_len=1024, new_tokens=140),
            gpu_only=True,
            note="the FastSeq paper's main setting: beam 4, no-repeat 3, 1024 input tokens",
        ),
        Scenario(
            "marian",
            "MarianConfig",
            "MarianMTModel",
            dict(
                vocab_size=58101,
                d_model=512,
                encoder_layers=6,
                decoder_layers=6,
                encoder_attention_heads=8,
                decoder_attention_heads=8,
                encoder_ffn_dim=2048,
                decoder_ffn_dim=2048,
                pad_token_id=58100,
                eos_token_id=0,
                decoder_start_token_id=58100,
                forced_eos_token_id=0,
                max_position_embeddings=512,
            ),
            batch=8,
            input_len=64,
            new_tokens=48,
            generate=dict(num_beams=4),
            cuda=dict(batch=64, input_len=128, new_tokens=128),
            note="translation: beam 4",
        ),
        Scenario(
            "t5-base",
            "T5Config",
            "T5ForConditionalGeneration",
            dict(
                vocab_size=32128,
                d_model=768,
                d_kv=64,
                d_ff=3072,
                num_layers=12,
                num_heads=12,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            ),
            batch=4,
            input_len=256,
            new_tokens=32,
            generate=_SUMMARY,
            cuda=dict(batch=32, input_len=512, new_tokens=140),
            note="summarisation: beam 4, no-repeat 3",
        ),
        Scenario(
            "gpt2",
            "GPT2Config",
            "GPT2LMHeadModel",
            dict(
                vocab_size=50257,
                n_embd=768,
                n_layer=12,
                n_head=12,
                n_positions=1024,
                pad_token_id=50256,
                bos_token_id=50256,
                eos_token_id=50256,
            ),
            batch=2,
            input_len=512,
            new_tokens=32,
            generate=dict(num_beams=4, no_repeat_ngram_size=3),
            cuda=dict(batch=16, input_len=512, new_tokens=128),
            note="decoder-only, 512-token prompt: beam 4, no-repeat 3",
        ),
        Scenario(
            "llama",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                vocab_size=32000,
                hidden_size=1024,
                intermediate_size=2816,
                num_hidden_layers=8,
                num_attention_heads=16,
                num_key_value_heads=4,
                max_position_embeddings=2048,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            batch=2,
            input_len=512,
            new_tokens=32,
            generate=dict(num_beams=4),
            cuda=dict(batch=16, input_len=1024, new_tokens=128),
            note="Llama-shaped decoder (GQA 16/4 heads, RoPE), 512-token prompt: beam 4",
        ),
    ]
}
