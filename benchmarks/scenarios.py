"""Benchmark scenarios: real model shapes with random weights, the seeds' generation settings.

Random weights are enough for speed: the work per step depends on shapes, and equal work is
forced with ``min_new_tokens == max_new_tokens`` (every hypothesis runs the full length).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers

from benchmarks.measure import kv_cache_bytes
from fastgen.optimizer.transformers.contract import CACHE


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one timed call returns: the token ids (for the identity check) and the KV-cache bytes.

    ``kv_cache_bytes`` are those of the cache the model decoded with (fastgen's deduplicated one),
    not of the returned cache, which fastgen folds back into upstream's layout; the fold is part
    of the timed call (``return_dict_in_generate=True``) and ``fold_seconds`` is its cost alone.
    """

    sequences: torch.Tensor
    kv_cache_bytes: dict[str, int]
    fold_seconds: float | None = None


def decoding_cache(model: torch.nn.Module, call: Callable[[], Any]) -> tuple[Any, Any]:
    """``call()``'s result and the cache it returns (``return_dict_in_generate``). Read from the output, not
    with a hook on the model: a forward hook would keep fastgen's lean decode step off (it skips that forward)."""
    out = call()
    return out, getattr(out, CACHE, None)


def fold_seconds(cache: Any) -> float | None:
    """Time of folding a deduplicated cache into upstream's layout (None for upstream's caches)."""
    if not hasattr(cache, "to_upstream"):
        return None
    start = time.perf_counter()
    cache.to_upstream()
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Scenario:
    """An HF model shape and generation settings; :meth:`prepare` returns the call to time."""

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

    def known_output_difference(self, device: str) -> str | None:
        """Why upstream and fastgen outputs differ on purpose here; None: they must be identical."""
        return None

    def build(
        self, device: str, dtype: torch.dtype, settings: dict[str, Any]
    ) -> tuple[transformers.PreTrainedModel, dict[str, torch.Tensor], dict[str, Any]]:
        """The model, inputs and ``generate`` kwargs that :meth:`prepare` times (for benchmarks timing parts of it)."""
        config = getattr(transformers, self.config_class)(**self.config)
        torch.manual_seed(0)
        model = getattr(transformers, self.model_class)(config).to(device=device, dtype=dtype).eval()
        inputs = self.inputs(model, settings["batch"], settings["input_len"])
        n = settings["new_tokens"]
        kwargs = dict(self.generate, max_new_tokens=n, min_new_tokens=n, return_dict_in_generate=True)
        return model, inputs, kwargs

    def prepare(self, device: str, dtype: torch.dtype, settings: dict[str, Any]) -> Callable[[], Generation]:
        model, inputs, kwargs = self.build(device, dtype, settings)

        def run() -> Generation:
            if kwargs.get("do_sample"):
                torch.manual_seed(0)  # same random stream for upstream and fastgen: comparable outputs
            out, cache = decoding_cache(model, lambda: model.generate(**inputs, **kwargs))
            return Generation(out.sequences, kv_cache_bytes(cache), fold_seconds(cache))

        return run

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


@dataclasses.dataclass(frozen=True)
class FairseqScenario(Scenario):
    """A fairseq ``transformer`` (``config`` holds its architecture args) run by ``SequenceGenerator``.

    ``min_len == max_len`` forces equal work; the cache bytes of fairseq's incremental state
    are not reported (the generator keeps them internal).
    """

    def prepare(self, device: str, dtype: torch.dtype, settings: dict[str, Any]) -> Callable[[], Generation]:
        import argparse

        from fairseq.data import Dictionary
        from fairseq.models.transformer import TransformerModel, base_architecture
        from fairseq.sequence_generator import SequenceGenerator

        dictionary = Dictionary()
        for i in range(self.config["vocab_size"] - len(dictionary)):
            dictionary.add_symbol(f"w{i}")
        args = argparse.Namespace(**{k: v for k, v in self.config.items() if k != "vocab_size"})
        base_architecture(args)

        class _Task:
            source_dictionary = target_dictionary = dictionary

        torch.manual_seed(0)
        model = TransformerModel.build_model(args, _Task()).to(device=device, dtype=dtype).eval()
        batch, length, n = settings["batch"], settings["input_len"], settings["new_tokens"]
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=generator)
        tokens[:, -1] = dictionary.eos()
        sample = {
            "net_input": {"src_tokens": tokens.to(device), "src_lengths": torch.full((batch,), length).to(device)}
        }
        search = SequenceGenerator([model], dictionary, max_len_a=0, max_len_b=n, min_len=n, **self.generate)

        def run() -> Generation:
            hypos = search.generate([model], sample)
            best = [h[0]["tokens"] for h in hypos]
            padded = torch.nn.utils.rnn.pad_sequence(best, batch_first=True, padding_value=dictionary.pad())
            return Generation(padded, {})

        return run

    def known_output_difference(self, device: str) -> str | None:
        """Upstream's n-gram blocker bans nothing unless its CUDA extension runs; fastgen's always blocks."""
        if not self.generate.get("no_repeat_ngram_size"):
            return None
        from fairseq.ngram_repeat_block import is_cuda_extension_usable

        if device == "cuda" and is_cuda_extension_usable():
            return None
        return (
            "upstream's NGramRepeatBlock runs its Python fallback here (no usable CUDA extension), which is "
            "handed the pad-filled token buffer and so bans nothing (fairseq #4709/#5206): upstream's output "
            "repeats n-grams despite no_repeat_ngram_size. fastgen blocks them as intended (the semantics of "
            "fairseq's CUDA kernel), so the outputs differ on purpose; see rows_with_repeated_ngrams"
        )


@dataclasses.dataclass(frozen=True)
class WhisperScenario(Scenario):
    """Whisper short-form decoding: ``input_len`` is the number of log-mel frames (3000 = 30 s).

    Random features of the real shape (no audio). Whisper's ``generate`` keeps the shared path only
    without ``return_dict_in_generate`` (it splits a returned cache per row), so the cache whose
    bytes are reported is taken from the decoder's last forward by a hook.
    """

    def prepare(self, device: str, dtype: torch.dtype, settings: dict[str, Any]) -> Callable[[], Generation]:
        config = getattr(transformers, self.config_class)(**self.config)
        torch.manual_seed(0)
        model = getattr(transformers, self.model_class)(config).to(device=device, dtype=dtype).eval()
        generator = torch.Generator().manual_seed(1)
        frames = settings["input_len"]
        features = torch.randn(settings["batch"], config.num_mel_bins, frames, generator=generator)
        features = features.to(device=device, dtype=dtype)
        n = settings["new_tokens"]
        kwargs = dict(self.generate, max_new_tokens=n, min_new_tokens=n)
        last: dict[str, Any] = {}

        def keep_cache(module: Any, args: Any, output: Any) -> None:
            last["cache"] = getattr(output, CACHE)

        model.register_forward_hook(keep_cache)

        def run() -> Generation:
            sequences = model.generate(input_features=features, **kwargs)
            return Generation(sequences, kv_cache_bytes(last.pop("cache", None)))

        return run


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
        WhisperScenario(
            "whisper-small",
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            dict(
                vocab_size=51865,
                num_mel_bins=80,
                d_model=768,
                encoder_layers=12,
                decoder_layers=12,
                encoder_attention_heads=12,
                decoder_attention_heads=12,
                encoder_ffn_dim=3072,
                decoder_ffn_dim=3072,
                max_source_positions=1500,
                max_target_positions=448,
                pad_token_id=50257,
                bos_token_id=50257,
                eos_token_id=50257,
                decoder_start_token_id=50258,
                suppress_tokens=None,
                begin_suppress_tokens=None,
            ),
            batch=1,
            input_len=3000,
            new_tokens=100,
            generate=dict(num_beams=5),
            cuda=dict(batch=16),
            note="Whisper-small shape, 30 s of log-mel features (3000 frames, 1500 encoder states): beam 5",
        ),
        Scenario(
            "nllb-600m",
            "M2M100Config",
            "M2M100ForConditionalGeneration",
            dict(
                vocab_size=256206,
                d_model=1024,
                encoder_layers=12,
                decoder_layers=12,
                encoder_attention_heads=16,
                decoder_attention_heads=16,
                encoder_ffn_dim=4096,
                decoder_ffn_dim=4096,
                max_position_embeddings=1024,
                scale_embedding=True,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
            ),
            batch=4,
            input_len=64,
            new_tokens=32,
            generate=dict(num_beams=4),
            cuda=dict(batch=32, input_len=128, new_tokens=128),
            note="NLLB-200-distilled-600M shape (M2M100, 12+12 layers, d=1024, vocab 256206), translation: beam 4",
        ),
        Scenario(
            "mistral-7b-scaled",
            "MistralConfig",
            "MistralForCausalLM",
            dict(
                vocab_size=32000,
                hidden_size=1024,
                intermediate_size=3584,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=128,
                max_position_embeddings=32768,
                sliding_window=4096,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            batch=1,
            input_len=512,
            new_tokens=32,
            generate=dict(do_sample=True, num_return_sequences=8, top_k=50),
            cuda=dict(batch=4, input_len=2048, new_tokens=128),
            note=(
                "Mistral-7B scaled to fit: head_dim 128, GQA 4:1 and sliding window 4096 kept; hidden 4096->1024, "
                "32->8 layers, 32/8->8/2 heads, FFN 14336->3584; best-of-8 sampling (seeded), 512-token prompt"
            ),
        ),
        FairseqScenario(
            "fairseq-transformer",
            "",
            "",
            dict(
                vocab_size=32000,
                encoder_embed_dim=512,
                encoder_ffn_embed_dim=2048,
                encoder_layers=6,
                encoder_attention_heads=8,
                decoder_embed_dim=512,
                decoder_ffn_embed_dim=2048,
                decoder_layers=6,
                decoder_attention_heads=8,
                share_all_embeddings=True,
                dropout=0.0,
            ),
            batch=8,
            input_len=128,
            new_tokens=48,
            generate=dict(beam_size=4, no_repeat_ngram_size=3),
            cuda=dict(batch=64, input_len=256, new_tokens=128),
            note="fairseq transformer (6+6, d=512) via SequenceGenerator: beam 4, no-repeat 3",
        ),
    ]
}
