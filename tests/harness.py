"""Tiny seeded models and the equivalence assertion every optimisation is tested with.

Models are built from configs with random weights (no downloads), small enough for CPU CI
but real enough to exercise caches, padding, cross-attention, several layers and heads and,
for Llama, grouped-query attention.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

import fastgen
from fastgen.optimizer.transformers.contract import CACHE

VOCAB = 96
PAD, BOS, EOS = 1, 0, 2

_COMMON_SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    decoder_start_token_id=EOS,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    forced_eos_token_id=EOS,
    # Untied, wider-than-default init: tiny tied models just repeat one token whatever the input.
    init_std=0.1,
    tie_word_embeddings=False,
)
_COMMON_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    initializer_range=0.3,
)

_T5_LIKE = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=32,
    dropout_rate=0.0,
    pad_token_id=PAD,
    eos_token_id=EOS,
    decoder_start_token_id=PAD,
    initializer_factor=3.0,
    tie_word_embeddings=False,
)
#: Whisper's encoder reads ``num_mel_bins`` x ``2 * max_source_positions`` log-mel frames (30 s for the real 1500).
WHISPER_MEL_BINS, WHISPER_SOURCE_POSITIONS = 8, 30

#: family -> (config class name, model class name, config kwargs)
HF_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bart": ("BartConfig", "BartForConditionalGeneration", _COMMON_SEQ2SEQ),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", _COMMON_SEQ2SEQ),
    "marian": ("MarianConfig", "MarianMTModel", {**_COMMON_SEQ2SEQ, "decoder_start_token_id": PAD}),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", {**_COMMON_SEQ2SEQ, "decoder_start_token_id": PAD}),
    "t5": ("T5Config", "T5ForConditionalGeneration", _T5_LIKE),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            initializer_range=0.3,
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _COMMON_DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _COMMON_DECODER),
    # ---- issue 11 families
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", _COMMON_SEQ2SEQ),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", _T5_LIKE),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", _T5_LIKE),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(
            vocab_size=VOCAB,
            num_mel_bins=WHISPER_MEL_BINS,
            max_source_positions=WHISPER_SOURCE_POSITIONS,  # 2x frames in the features (conv stride 2)
            max_target_positions=64,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            decoder_start_token_id=BOS,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            init_std=0.3,
            tie_word_embeddings=False,
        ),
    ),
    # Mistral's default 4096-token sliding window on every layer: the window never cuts in these tests.
    "mistral": ("MistralConfig", "MistralForCausalLM", _COMMON_DECODER),
    # Qwen3 with its optional sliding window on the upper layers: alternating full / sliding layers.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_COMMON_DECODER, head_dim=8, use_sliding_window=True, sliding_window=64, max_window_layers=1),
    ),
    # Gemma 2: alternating sliding / full layers and attention logit soft-capping (eager). A small cap so
    # that it bends the tiny model's scores (the real models use 50).
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _COMMON_DECODER,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=64,
            attn_logit_softcapping=2.0,
            tie_word_embeddings=False,  # tied, the tiny Gemma repeats its last prompt token
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _COMMON_DECODER,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_COMMON_DECODER, sliding_window=64)),
}
ENCODER_DECODER = ("bart", "mbart", "marian", "pegasus", "t5", "m2m_100", "mt5", "umt5", "whisper")
#: ``generate`` settings the dedup tests run: the multi-hypothesis modes fastgen changes, and greedy,
#: which it must leave alone.
DEDUP_CASES: dict[str, dict[str, Any]] = {
    "beam": dict(num_beams=4),
    "beam_no_repeat": dict(num_beams=4, no_repeat_ngram_size=2),
    "beam_return_2": dict(num_beams=4, num_return_sequences=2),
    "beam_sample": dict(num_beams=3, do_sample=True, top_k=20),
    "sample_return_3": dict(do_sample=True, num_return_sequences=3),
    "greedy": dict(),
}
DECODER_ONLY = ("gpt2", "llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3")


def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A seeded, randomly initialised tiny model of ``family`` in eval mode (fp32, CPU)."""
    config_name, model_name, kwargs = HF_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # Random weights put little mass on EOS; leave generation_config at its defaults otherwise.
    model.generation_config.pad_token_id = PAD
    return model


def tiny_inputs(
    model: transformers.PreTrainedModel, batch: int = 2, length: int = 12, seed: int = 1, padded: bool = True
) -> dict[str, torch.Tensor]:
    """Random token ids with an attention mask; row i is shorter by ``2*i`` tokens when ``padded``.

    Decoder-only models get left padding (what HF expects for generation), encoder-decoder
    models right padding.
    """
    if model.config.model_type == "whisper":
        return tiny_log_mel(model.config, batch, seed, padded)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(batch):
            pad = min(2 * row, length - 1)
            if pad:
                if model.config.is_encoder_decoder:
                    mask[row, length - pad :] = 0
                else:
                    mask[row, :pad] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask}


def tiny_log_mel(config: Any, batch: int = 2, seed: int = 1, padded: bool = True) -> dict[str, torch.Tensor]:
    """Random log-mel features of Whisper's shape: ``num_mel_bins`` x ``2 * max_source_positions`` frames.

    Whisper pads every clip to 30 s of features and takes no encoder mask; with ``padded``, row ``i``
    ends in ``i`` eighths of constant "silence" (the padded floor value), as shorter clips do.
    """
    generator = torch.Generator().manual_seed(seed)
    frames = 2 * config.max_source_positions
    features = torch.randn(batch, config.num_mel_bins, frames, generator=generator)
    if padded:
        for row in range(batch):
            silence = frames * row // 8
            if silence:
                features[row, :, frames - silence :] = -1.5
    return {"input_features": features}


def feature_unavailable(feature: str, package: str = "transformers") -> str | None:
    """Why ``feature``'s patches of ``package`` are skipped for the installed version, or None.

    Tests that assert a mechanism (not just equal outputs) skip with this reason; equality tests
    still run, since a skipped patch must leave upstream behaviour intact.
    """
    from fastgen.optimizer import registry

    problems = [
        registry.version_problem(p)
        for p in registry.declared_patches()
        if p.feature == feature and p.package == package
    ]
    return next((p for p in problems if p), None)


def requires_feature(feature: str, package: str = "transformers") -> pytest.MarkDecorator:
    """Skip mark for tests of a feature's mechanism where its patches are not declared for this version."""
    reason = feature_unavailable(feature, package)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def record_fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Collect every fallback reason the dedup hooks report (the warnings themselves are shown once per process)."""
    from fastgen.optimizer import registry
    from fastgen.optimizer.transformers import dedup

    reasons: list[str] = []
    original = registry.fallback

    def record(feature: str, reason: str) -> None:
        reasons.append(reason)
        original(feature, reason)

    monkeypatch.setattr(registry, "fallback", record)
    monkeypatch.setattr(dedup, "fallback", record)
    return reasons


def force_in_place_reorder(monkeypatch: pytest.MonkeyPatch, in_place: bool) -> list[bool]:
    """Make :func:`fastgen.ops.reorder.possible` (may the caches reorder rows in place) answer as it does
    (``in_place``; skipped where the CPU kernels are absent) or always no (the spare-buffer gather); returns the
    list of its answers, for the test to assert that the path it names ran."""
    from fastgen.ops import cpu_kernels, reorder

    if in_place and not cpu_kernels.available():
        pytest.skip(str(cpu_kernels.unavailable_reason()))
    decided: list[bool] = []
    choose = reorder.possible if in_place else (lambda *args: False)
    monkeypatch.setattr(reorder, "possible", lambda *args: decided.append(choose(*args)) or decided[-1])
    return decided


# ------------------------------------------------------------------------------ equivalence


def _first_mismatch(reference: torch.Tensor, candidate: torch.Tensor) -> str:
    if reference.shape != candidate.shape:
        return f"shapes differ: upstream {tuple(reference.shape)} vs fastgen {tuple(candidate.shape)}"
    rows = (reference != candidate).any(dim=-1).nonzero().flatten().tolist()
    row = rows[0]
    return (
        f"{len(rows)} row(s) differ, first row {row}:\n"
        f" upstream {reference[row].tolist()}\n fastgen  {candidate[row].tolist()}"
    )


def assert_close_scores(
    reference: torch.Tensor, candidate: torch.Tensor, what: str, atol: float, rtol: float, scale: float = 0.0
) -> None:
    """Equal where either is infinite, close elsewhere; reports the worst element on failure.

    ``scale``: the magnitude the values were computed from, when larger than their own (a sequence score
    sums log-probs, each as exact as the largest logit of its step allows).
    """
    ref_inf, cand_inf = torch.isinf(reference), torch.isinf(candidate)
    assert torch.equal(ref_inf, cand_inf) and torch.equal(reference[ref_inf], candidate[cand_inf]), (
        f"{what}: -inf/+inf positions differ ({int((ref_inf != cand_inf).sum())} elements)"
    )
    finite = ~ref_inf
    # fp32 log-probs carry an absolute error of a few ulp of the largest logit (log_softmax subtracts a
    # logsumexp of that size), so the absolute tolerance scales with the largest finite score.
    scale = max(scale, reference[finite].abs().max().item() if finite.any() else 0.0)
    atol = max(atol, rtol * scale)
    torch.testing.assert_close(candidate[finite], reference[finite], atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_same_generation(
    model: transformers.PreTrainedModel,
    inputs: dict[str, torch.Tensor],
    *,
    features: list[str] | None = None,
    seed: int = 0,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    with_report: bool = False,
    **generate_kwargs: Any,
) -> tuple[Any, ...]:
    """Run ``generate`` upstream (``fastgen.unpatched()``) and patched on the same inputs.

    Sequences must be identical; ``sequences_scores`` and the per-step processed scores
    must match within ``atol``/``rtol`` (fp32). Sampling is reseeded identically for both.
    Returns both outputs so tests can assert more, and with ``with_report`` the patched call's
    :class:`fastgen.Report` (which features ran, which fell back).
    """
    kwargs = {"return_dict_in_generate": True, "output_scores": True, **generate_kwargs}
    with fastgen.unpatched():
        torch.manual_seed(seed)
        reference = model.generate(**inputs, **kwargs)
    with fastgen.patched(features), fastgen.report() as report:
        torch.manual_seed(seed)
        candidate = model.generate(**inputs, **kwargs)
    ref_seq = reference.sequences if kwargs["return_dict_in_generate"] else reference
    cand_seq = candidate.sequences if kwargs["return_dict_in_generate"] else candidate
    assert ref_seq.shape == cand_seq.shape and torch.equal(ref_seq, cand_seq), _first_mismatch(ref_seq, cand_seq)
    if kwargs["return_dict_in_generate"]:
        if getattr(reference, "sequences_scores", None) is not None:
            steps = [step[torch.isfinite(step)] for step in reference.scores or ()]
            step_scale = max((step.abs().max().item() for step in steps if step.numel()), default=0.0)
            assert_close_scores(
                reference.sequences_scores, candidate.sequences_scores, "sequences_scores", atol, rtol, step_scale
            )
        if reference.scores is not None:
            assert len(reference.scores) == len(candidate.scores)
            for step, (ref, cand) in enumerate(zip(reference.scores, candidate.scores, strict=True)):
                assert_close_scores(ref, cand, f"scores at step {step}", atol, rtol)
    return (reference, candidate, report) if with_report else (reference, candidate)


@contextlib.contextmanager
def fastgen_disabled() -> Iterator[None]:
    """``fastgen.disable()`` inside the block; the previous selection of features afterwards."""
    from fastgen.optimizer import registry

    previous = registry._state.enabled_features
    fastgen.disable()
    try:
        yield
    finally:
        if previous is not None:
            fastgen.enable(sorted(previous))


@contextlib.contextmanager
def recorded_caches(model: torch.nn.Module) -> Iterator[list[Any]]:
    """The distinct ``past_key_values`` objects ``model``'s forward received inside the block.

    ``generate`` returns caches in upstream's layout; this shows the cache a call really decoded with.
    """
    seen: list[Any] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get(CACHE)
        if cache is not None and all(cache is not other for other in seen):
            seen.append(cache)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


# ------------------------------------------------------------------------------ fairseq


@contextlib.contextmanager
def _keep_logging() -> Iterator[None]:
    """fairseq sets the root logger to DEBUG on import; undo that for the test session."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def tiny_fairseq_transformer(seed: int = 0, vocab: int = 64) -> tuple[Any, Any]:
    """A seeded tiny fairseq ``transformer`` (2+2 layers, 4 heads) and its dictionary."""
    with _keep_logging():
        from fairseq.data import Dictionary
        from fairseq.models.transformer import TransformerModel, base_architecture

    dictionary = Dictionary()
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    args = argparse.Namespace(
        encoder_embed_dim=32,
        encoder_ffn_embed_dim=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_layers=2,
        decoder_attention_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_source_positions=256,
        max_target_positions=256,
        share_all_embeddings=True,
        share_decoder_input_output_embed=True,
    )
    base_architecture(args)

    class _Task:
        source_dictionary = target_dictionary = dictionary

    torch.manual_seed(seed)
    model = TransformerModel.build_model(args, _Task()).eval()
    with torch.no_grad():  # wider init: at fairseq's default a tiny model ignores its input
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed" not in name:
                param.mul_(2.0)
    return model, dictionary


def tiny_fairseq_sample(dictionary: Any, batch: int = 3, length: int = 10, seed: int = 1) -> dict[str, Any]:
    """A left-padded source batch (fairseq's default) with distinct lengths and EOS-terminated rows."""
    generator = torch.Generator().manual_seed(seed)
    nspecial = dictionary.nspecial
    lengths = torch.tensor([max(2, length - 2 * i) for i in range(batch)])
    tokens = torch.full((batch, length), dictionary.pad())
    for row, n in enumerate(lengths.tolist()):
        body = torch.randint(nspecial, len(dictionary), (n - 1,), generator=generator)
        tokens[row, length - n :] = torch.cat([body, torch.tensor([dictionary.eos()])])
    return {"id": torch.arange(batch), "net_input": {"src_tokens": tokens, "src_lengths": lengths}}


def fairseq_generate(
    model: Any, dictionary: Any, sample: dict[str, Any], seed: int = 0, **generator_kwargs: Any
) -> list[list[dict[str, torch.Tensor]]]:
    """``SequenceGenerator(...).generate`` as a fairseq user calls it."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], dictionary, **generator_kwargs)
    torch.manual_seed(seed)
    with torch.no_grad():
        return generator.generate([model], sample)


def assert_same_fairseq_generation(
    model: Any,
    dictionary: Any,
    sample: dict[str, Any],
    *,
    features: list[str] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    **generator_kwargs: Any,
) -> tuple[Any, Any]:
    """fairseq counterpart of :func:`assert_same_generation`: hypotheses equal, scores close."""
    with fastgen.unpatched():
        reference = fairseq_generate(model, dictionary, sample, **generator_kwargs)
    with fastgen.patched(features):
        candidate = fairseq_generate(model, dictionary, sample, **generator_kwargs)
    assert len(reference) == len(candidate)
    for i, (ref_hypos, cand_hypos) in enumerate(zip(reference, candidate, strict=True)):
        assert len(ref_hypos) == len(cand_hypos), f"sentence {i}: hypothesis counts differ"
        for j, (ref, cand) in enumerate(zip(ref_hypos, cand_hypos, strict=True)):
            assert torch.equal(ref["tokens"], cand["tokens"]), (
                f"sentence {i} hypothesis {j}:\n upstream {ref['tokens'].tolist()}\n fastgen  {cand['tokens'].tolist()}"
            )
            assert math.isclose(float(ref["score"]), float(cand["score"]), rel_tol=rtol, abs_tol=atol)
            assert_close_scores(
                ref["positional_scores"], cand["positional_scores"], f"sentence {i} hypo {j}", atol, rtol
            )
    return reference, candidate


def has_repeated_ngram(tokens: list[int], n: int) -> bool:
    """True when some n-gram occurs twice in ``tokens`` (the property n-gram blocking prevents)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


def family_case_grid(families, cases, in_ci) -> list:
    """``pytest.param(family, case)`` for every pair (id ``family-case``), cases outer; a pair ``in_ci(family,
    case)`` refuses is marked slow (it runs with ``-m slow``, not in CI)."""
    return [
        pytest.param(family, case, id=f"{family}-{case}", marks=() if in_ci(family, case) else pytest.mark.slow)
        for case in cases
        for family in families
    ]


def non_degenerate(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """``model``, after asserting that none of its matrices is constant (a tiny random model must not hide a
    difference behind equal weights)."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight") and p.dim() == 2]
    assert all(w.std() > 0.01 for w in weights), "a degenerate (constant) weight in the tiny model"
    return model


def assert_leaving_inputs_match_upstream(model: transformers.PreTrainedModel) -> Any:
    """Beam search where a quarter of the vocabulary ends a hypothesis (inputs finish at different steps and
    leave the batch): tokens equal upstream's. Returns the patched call's :class:`fastgen.Report`."""
    inputs = tiny_inputs(model, batch=4, length=10)
    kwargs = dict(num_beams=3, max_new_tokens=16, eos_token_id=list(range(3, 30)), early_stopping=True)
    with fastgen.unpatched(), torch.no_grad():
        reference = model.generate(**inputs, **kwargs)
    with fastgen.report() as report, torch.no_grad():
        candidate = model.generate(**inputs, **kwargs)
    assert torch.equal(candidate, reference)
    assert "finished inputs left the batch" in report.ran.get("beam", [])
    return report


def generate_with_step(model, inputs, lean: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[Any, Any]:
    """``generate`` (scores returned, seed 0) with the lean decode step on or off (``FASTGEN_LEAN_STEP``), and its
    :class:`fastgen.Report`."""
    monkeypatch.setenv("FASTGEN_LEAN_STEP", "1" if lean else "0")
    with fastgen.report() as report, torch.no_grad():
        torch.manual_seed(0)
        out = model.generate(**inputs, return_dict_in_generate=True, output_scores=True, **kwargs)
    return out, report
