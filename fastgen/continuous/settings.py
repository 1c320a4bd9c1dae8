"""Which ``generate`` calls continuous batching serves, and the settings it reads from them.

Admission is by allow-list (DESIGN §8): the model's ``generation_config`` updated with the call's
kwargs is compared field by field against ``GenerationConfig()``'s defaults; a field that differs and
is not in :data:`SUPPORTED_FIELDS` (constraints, custom processors, output dicts, ...) sends the whole
call to plain ``generate`` per static batch, with one warning naming it. Sampling is served with
``num_beams == 1`` and the warpers temperature, top-k, top-p and min-p; beam sampling and the other
warpers (typical, epsilon, eta) fall back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import GenerationConfig

from fastgen.continuous.families import ADAPTERS, path_problem
from fastgen.optimizer.transformers.contract import CACHE

#: the ``config.model_type`` s served: those with an adapter (cross K/V projection, per-row positions)
#: in :mod:`fastgen.continuous.families`
FAMILIES = tuple(ADAPTERS)
#: decoder-only ``config.model_type`` s served (:mod:`fastgen.continuous.decoder_only`): their forward takes
#: per-row ``position_ids`` and a 2-D attention mask, and reads the cache only through ``Cache.update``
#: and the mask sizes, so the slot cache and per-row positions need no model code.
DECODER_ONLY_FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "qwen3")

#: generation settings the scheduler implements (upstream's semantics per input)
SUPPORTED_FIELDS = frozenset(
    {
        "num_beams",
        "num_return_sequences",
        "max_length",
        "max_new_tokens",
        "min_length",
        "min_new_tokens",
        "length_penalty",
        "early_stopping",
        "no_repeat_ngram_size",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "use_cache",
        "do_sample",  # sampling with num_beams == 1 (beam sampling falls back)
        "temperature",
        "top_k",
        "top_p",
        "min_p",
    }
)
#: fields that never change the tokens (bookkeeping, or read only by other decoding modes)
_IGNORED_FIELDS = frozenset(
    {"transformers_version", "_from_model_config", "_commit_hash", "output_scores", "return_dict_in_generate"}
)
#: sampling warpers upstream reads only when ``do_sample=True`` (ignored otherwise, as upstream ignores them);
#: the ones not in SUPPORTED_FIELDS fall back under ``do_sample=True`` when they would act
_SAMPLING_FIELDS = frozenset({"temperature", "top_k", "top_p", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff"})
#: values of other fields that change nothing (so a config that spells them out is still served)
_NEUTRAL = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
}


def _is_default(key: str, value: Any, default: Any) -> bool:
    if value == default or (value in (None, False) and default in (None, False)):
        return True
    return key in _NEUTRAL and value == _NEUTRAL[key]


def switched_on() -> bool:
    """Whether ``generate_many`` runs continuous batching: not as defined here. The "continuous" patch
    (:mod:`fastgen.optimizer.transformers.patches`) replaces this function while the feature is applied, so
    ``fastgen.enable(features=[...])``, ``FASTGEN_FEATURES``, ``disable()`` and ``unpatched()`` (this thread
    only) switch continuous batching as they switch every other feature, and ``status()`` lists it. Read it
    through the module (``settings.switched_on()``), where the patch installs itself."""
    return False


def make_switched_on(original: Callable[[], bool]) -> Callable[[], bool]:
    """The "continuous" patch's replacement of :func:`switched_on`."""

    def switched_on() -> bool:
        return True

    return switched_on


def cache_kwarg(model: Any) -> str:
    """The name under which a model's forward takes its cache, from the contract (5.24 renamed it)."""
    return CACHE


@dataclass(frozen=True)
class Settings:
    """One call's decoding settings, resolved as ``generate`` resolves them for an encoder-decoder model."""

    num_beams: int
    num_return_sequences: int
    max_length: int  # decoder length limit, the decoder start token included
    min_length: int
    min_new_tokens: int
    length_penalty: float
    early_stopping: bool | str
    no_repeat_ngram_size: int
    forced_bos_token_id: int | None
    forced_eos_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    decoder_start_token_id: int | None  # None for decoder-only models (their rows start with the prompt)
    # multinomial sampling (num_beams == 1) and its warpers, as generate's config holds them
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    #: decoder-only: new tokens per input (``max_length`` is then derived per prompt, see :meth:`length_limit`)
    max_new_tokens: int | None = None
    length_cap: int | None = None  # decoder-only default length: capped at max_position_embeddings

    @property
    def rows_per_input(self) -> int:
        """Decoder rows per input, as ``generate`` expands them: beams, or the samples returned."""
        return self.num_return_sequences if self.do_sample else self.num_beams

    def length_limit(self, prompt_length: int) -> int:
        """An input's total length limit (prompt included), as ``generate`` derives ``max_length`` for it."""
        if self.max_new_tokens is None:
            return self.max_length
        limit = prompt_length + self.max_new_tokens
        return limit if self.length_cap is None else min(limit, self.length_cap)

    @property
    def fill_value(self) -> int:
        """What upstream's beam search fills unused sequence positions with."""
        if not self.eos_token_ids:
            return -1
        return self.pad_token_id or self.eos_token_ids[0]

    def eos_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1).tolist())
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def resolve(model: Any, kwargs: dict[str, Any]) -> tuple[Settings | None, str | None]:
    """The settings of ``model.generate(**kwargs)`` for one input, or the reason this scheduler cannot serve it."""
    if not switched_on():
        return None, "feature 'continuous' is switched off (fastgen.enable, FASTGEN_FEATURES or unpatched())"
    config = model.config
    decoder_only = not getattr(config, "is_encoder_decoder", False)
    families = DECODER_ONLY_FAMILIES if decoder_only else FAMILIES
    if config.model_type not in families:
        return None, f"model type {config.model_type!r} (supported: {', '.join(FAMILIES + DECODER_ONLY_FAMILIES)})"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None, f"attention implementation {getattr(config, '_attn_implementation', None)!r}"
    if model.training:
        return None, "the model is in training mode"
    problem = _module_problem(model, decoder_only)
    if problem is not None:
        return None, problem
    kwargs = dict(kwargs)
    given_config = kwargs.get("generation_config")
    # private (listed in the contract's inventory): model config < kwargs, global defaults, as generate merges them
    gen, model_kwargs = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    extra = sorted(k for k, v in model_kwargs.items() if v is not None)
    if extra:
        return None, f"argument {extra[0]!r}"
    # private (listed in the contract's inventory): the values generate fills in for None
    defaults = GenerationConfig()
    defaults.update(**GenerationConfig._get_default_generation_params())
    defaults = defaults.to_dict()
    for key, value in gen.to_dict().items():
        if key in SUPPORTED_FIELDS or key in _IGNORED_FIELDS or key in _SAMPLING_FIELDS or key.startswith("_"):
            continue
        if key in defaults and not _is_default(key, value, defaults[key]):
            return None, f"generation setting {key}={value!r}"
    if gen.do_sample:
        if (gen.num_beams or 1) > 1:
            return None, "do_sample=True with num_beams > 1 (beam sampling)"
        unsupported = _active_unsupported_warper(gen)
        if unsupported:
            return None, f"sampling setting {unsupported}"
    if gen.use_cache is False:
        return None, "use_cache=False"
    if gen.return_dict_in_generate:
        return None, "return_dict_in_generate=True"
    beams = gen.num_beams or 1
    returns = gen.num_return_sequences or 1
    if returns > beams and not gen.do_sample:
        return None, f"num_return_sequences={returns} > num_beams={beams} (upstream raises)"
    if decoder_only:
        lengths = _decoder_only_lengths(model, kwargs, given_config, gen)
    else:
        start = gen.decoder_start_token_id if gen.decoder_start_token_id is not None else config.decoder_start_token_id
        if start is None:
            return None, "no decoder_start_token_id"
        lengths = dict(
            max_length=_encoder_decoder_max_length(model, kwargs, given_config, gen),
            min_length=int(gen.min_length or 0),
            decoder_start_token_id=int(start),
        )
    eos = _ids(gen.eos_token_id)
    pad = gen.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # as generate: pad falls back to the (first) EOS
    early = gen.early_stopping
    settings = Settings(
        num_beams=beams,
        num_return_sequences=returns,
        min_new_tokens=int(gen.min_new_tokens or 0),
        length_penalty=float(gen.length_penalty),
        early_stopping=early,
        no_repeat_ngram_size=int(gen.no_repeat_ngram_size or 0),
        forced_bos_token_id=gen.forced_bos_token_id,
        forced_eos_token_ids=_ids(gen.forced_eos_token_id),
        eos_token_ids=eos,
        pad_token_id=pad,
        **lengths,
    )
    if gen.do_sample:
        settings = replace(
            settings,
            do_sample=True,
            temperature=float(gen.temperature if gen.temperature is not None else 1.0),
            top_k=gen.top_k,
            top_p=float(gen.top_p if gen.top_p is not None else 1.0),
            min_p=gen.min_p,
        )
    return settings, None


def _module_problem(model: Any, decoder_only: bool) -> str | None:
    """A compiled module (``model.compile()``, ``model.forward = torch.compile(model.forward)``, a compiled layer):
    the decoder step would run under compilation, where fastgen's attention steps aside for upstream's
    layout (one cross K/V row per input then meets every beam's query) and each new row count recompiles,
    so such a model runs ``generate``. Encoder-decoder models also need the modules their position hooks
    replace to run their class's forward (:func:`~fastgen.continuous.families.path_problem`)."""
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if getattr(module, "_compiled_call_impl", None) is not None or hasattr(forward, "_torchdynamo_orig_callable"):
            return f"{'module ' + name if name else 'the model'} is compiled (torch.compile)"
    if decoder_only:
        return None
    return path_problem(model, ADAPTERS[model.config.model_type].hooked)


def _active_unsupported_warper(gen: GenerationConfig) -> str | None:
    """A sampling warper upstream would add (its own conditions) that the sampling step does not apply."""
    if gen.typical_p is not None and gen.typical_p < 1.0:
        return f"typical_p={gen.typical_p!r}"
    for key in ("epsilon_cutoff", "eta_cutoff"):
        value = getattr(gen, key)
        if value is not None and 0.0 < value < 1.0:
            return f"{key}={value!r}"
    return None


def _has_default_max_length(model: Any, kwargs: dict[str, Any], given: GenerationConfig | None) -> bool:
    """``generate``'s ``has_default_max_length``: no ``max_length`` in the call, its config or the model's."""
    return (
        kwargs.get("max_length") is None
        and (given is None or given.max_length is None)
        and model.generation_config.max_length is None
    )


def _encoder_decoder_max_length(
    model: Any, kwargs: dict[str, Any], given: GenerationConfig | None, gen: GenerationConfig
) -> int:
    """The decoder length limit (start token included) as ``generate``'s ``_prepare_generated_length`` sets it
    for an encoder-decoder model, whose ``input_ids`` are the one decoder start token: ``max_new_tokens + 1``;
    else an explicit ``max_length`` as given; else the default (20) counts *new* tokens, so ``20 + 1``, capped
    at ``max_position_embeddings`` where the config has one."""
    if gen.max_new_tokens is not None:
        return int(gen.max_new_tokens) + 1
    if not _has_default_max_length(model, kwargs, given):
        return int(gen.max_length)
    limit = int(gen.max_length) + 1
    cap = getattr(model.config, "max_position_embeddings", None)
    return limit if cap is None else min(limit, int(cap))


def _decoder_only_lengths(
    model: Any, kwargs: dict[str, Any], given: GenerationConfig | None, gen: GenerationConfig
) -> dict[str, Any]:
    """Length settings of a decoder-only call, per prompt as ``generate`` derives them (its
    ``_prepare_generated_length``): ``max_new_tokens`` wins; without it and without an explicit ``max_length``
    the default counts new tokens, capped at ``max_position_embeddings``; ``min_new_tokens`` replaces
    ``min_length``."""
    default_max = _has_default_max_length(model, kwargs, given)
    cap = None
    max_new = gen.max_new_tokens
    if max_new is None and default_max:
        max_new = GenerationConfig._get_default_generation_params()["max_length"]
        cap = getattr(model.config, "max_position_embeddings", None)
    min_length = 0 if gen.min_new_tokens is not None else int(gen.min_length or 0)
    return dict(
        max_length=int(gen.max_length or 0),
        min_length=min_length,
        decoder_start_token_id=None,
        max_new_tokens=None if max_new is None else int(max_new),
        length_cap=cap,
    )
