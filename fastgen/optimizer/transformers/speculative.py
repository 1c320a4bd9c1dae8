"""Batched speculative decoding (BASS-PAD) for ``generate(assistant_model=...)`` and prompt lookup.

Transformers 5.x runs assisted generation only at batch size 1 (``_assisted_decoding`` raises
otherwise) and rolls its cache back by one length for the whole batch. fastgen replaces
``GenerationMixin._assisted_decoding`` for batch > 1 with its own loop:

1. the main model prefills the prompt and picks the first token exactly as regular decoding does;
2. per step, one draft length ``k`` for the batch (:mod:`.draft_length`, BASS Algorithm 1 by
   default); the draft model proposes ``k`` tokens per row (or prompt lookup finds up to ``k``);
3. the main model scores ``[last token, drafts]`` of every row in one forward;
4. each row accepts its own number of drafts (:mod:`fastgen.ops.speculation`: argmax match for
   greedy, Leviathan et al.'s rule for sampling) plus one token of the main model's;
5. both caches keep each row's accepted entries only (:class:`~fastgen.models.ragged_cache.RaggedCache`:
   rows right-aligned, per-row lengths, 2D masks and positions; Transformers' own sdpa/eager
   attention reads them through the mask);
6. rows that finish (EOS, length) leave the batch and the caches.

The output is what regular decoding returns: greedy token for token (each row's tokens are the
main model's argmaxes given its own prefix), sampling in distribution. Batch 1 and every call this
loop does not support run upstream's code (with one warning naming the reason when batch > 1).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fastgen.models.ragged_cache import RaggedCache
from fastgen.ops.speculation import (
    greedy_accept,
    prompt_lookup_drafts,
    sampled_match_accept,
    speculative_sampling_accept,
)
from fastgen.optimizer.registry import fallback
from fastgen.optimizer.transformers import speculative_stats
from fastgen.optimizer.transformers.beam_search import other_device_reason
from fastgen.optimizer.transformers.contract import CACHE
from fastgen.optimizer.transformers.draft_length import DraftLength, check_options

FEATURE = "speculative"
#: Model classes whose forward takes (input_ids, attention_mask, position_ids, cache) and
#: whose default cache is a plain DynamicCache; tests prove each equal to regular decoding.
MODEL_FAMILIES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
MODEL_CLASSES = tuple(MODEL_FAMILIES.values())
ATTENTION = ("sdpa", "eager")
#: Processors that read only the scores (not the prefix or its length): applied per position they
#: give what regular decoding gives. Others (repetition penalty, n-gram blocking, min length…) read
#: the row's prefix, whose length differs per row here.
PROCESSORS = (
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "SuppressTokensLogitsProcessor",
)
STOPPING = ("MaxLengthCriteria", "EosTokenCriteria")
MODEL_KWARGS = {"attention_mask", "position_ids", CACHE, "use_cache", "logits_to_keep"}
OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
#: Settings that change what is drafted or how it is judged. (``assistant_lookbehind`` /
#: ``target_lookbehind`` only matter with two tokenizers, which falls back anyway;
#: ``assistant_confidence_threshold`` only stops drafting early, the output does not depend on it.)
UNSUPPORTED_CONFIG = ("assistant_early_exit", "assistant_ensemble_weight", "cache_implementation")


def make_assisted_decoding(original):
    def assisted_decoding(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        inputs_tensor=None,
        assistant_model=None,
        assistant_tokenizer=None,
        tokenizer=None,
        **model_kwargs,
    ):
        args = (self, input_ids, logits_processor, stopping_criteria, generation_config)
        kwargs = dict(
            synced_gpus=synced_gpus,
            streamer=streamer,
            inputs_tensor=inputs_tensor,
            assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer,
            tokenizer=tokenizer,
            **model_kwargs,
        )
        check_options(generation_config)  # fastgen's own options: a bad value is an error, at any batch size
        if input_ids.dim() != 2 or input_ids.shape[0] <= 1:
            return original(*args, **kwargs)  # batch 1 is upstream's supported case: leave it alone
        problem = other_device_reason(input_ids, self) or call_problem(
            self, generation_config, logits_processor, stopping_criteria, kwargs
        )
        if problem:
            fallback(FEATURE, f"batched assisted decoding: {problem}")
            return original(*args, **kwargs)
        with torch.no_grad():
            sequences = speculative_generate(
                self, assistant_model, input_ids, logits_processor, generation_config, model_kwargs
            )
        speculative_stats.record(FEATURE, input_ids.shape[0], assistant_model is None, last_stats)
        if generation_config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    return assisted_decoding


def call_problem(model, generation_config, logits_processor, stopping_criteria, kwargs: dict[str, Any]) -> str | None:
    """Why fastgen's loop cannot run this call exactly, or None."""
    draft = kwargs["assistant_model"]
    lookup = generation_config.prompt_lookup_num_tokens is not None and draft is None
    for name, value in (("model", model), ("assistant model", draft)):
        if value is None:
            continue
        if value.config.is_encoder_decoder:
            return f"{name} {type(value).__name__} is an encoder-decoder model (the loop keeps decoder-only caches)"
        if type(value).__name__ not in MODEL_CLASSES:
            return f"{name} class {type(value).__name__} (supported: {', '.join(MODEL_CLASSES)})"
        if any(t != "full_attention" for t in getattr(value.config, "layer_types", None) or ()):
            return f"{name} has sliding-window layers (their caches crop themselves; rows here are ragged)"
        attention = value.config._attn_implementation
        if attention not in ATTENTION:
            return f"{name} attention implementation {attention!r} (supported: {', '.join(ATTENTION)})"
    if draft is None and not lookup:
        return "no assistant model and no prompt lookup"
    if draft is not None and draft.config.vocab_size != model.config.vocab_size:
        return "assistant vocabulary size differs from the model's"
    if draft is not None and draft.device != model.device:
        return "assistant model on another device"
    for name in ("assistant_tokenizer", "tokenizer", "streamer"):
        if kwargs.get(name) is not None:
            return f"{name} given"
    if kwargs.get("synced_gpus"):
        return "synced_gpus"
    for flag in OUTPUT_FLAGS:
        if getattr(generation_config, flag, False):
            return f"{flag}=True (per-step outputs of ragged rows have no upstream layout)"
    for name in UNSUPPORTED_CONFIG:
        if getattr(generation_config, name, None) not in (None, False):
            return f"{name}={getattr(generation_config, name)!r}"
    if getattr(generation_config, "use_mtp", False) or getattr(generation_config, "speculation_type", None):
        return "multi-token prediction / speculation_type"
    extra = sorted(k for k, v in kwargs.items() if k not in MODEL_KWARGS and v is not None and k not in _LOOP_ARGS)
    if extra:
        return f"model inputs {extra}"
    if not kwargs.get("use_cache", True):
        return "use_cache=False"
    cache = kwargs.get(CACHE)
    if cache is not None and (type(cache).__name__ != "DynamicCache" or cache.get_seq_length() > 0):
        return f"a user-supplied cache ({type(cache).__name__})"
    for processor in logits_processor:
        if type(processor).__name__ not in PROCESSORS:
            return f"logits processor {type(processor).__name__} reads the prefix"
    for criterion in stopping_criteria:
        if type(criterion).__name__ not in STOPPING:
            return f"stopping criterion {type(criterion).__name__}"
    if generation_config._eos_token_tensor is not None and generation_config._pad_token_tensor is None:
        return "eos_token_id without pad_token_id"
    position_ids = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if position_ids is not None and mask is not None:
        expected = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if position_ids.shape != mask.shape or not torch.equal(position_ids.masked_fill(mask == 0, 0), expected):
            return "custom position_ids"
    if mask is not None and bool((mask[:, -1] == 0).any()):
        return "right padding"
    return None


#: Counters of the last call that ran fastgen's loop, and when each row finished (for benchmarks and
#: diagnostics; not thread-local).
last_stats: dict[str, Any] = {}

_LOOP_ARGS = {"synced_gpus", "streamer", "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer"}


def _scores(processors, logits: torch.Tensor) -> torch.Tensor:
    """Apply the (prefix-independent) processors to every position of (B, P, V) fp32 logits."""
    logits = logits.float()
    if not len(processors):
        return logits
    batch, positions, vocab = logits.shape
    flat = logits.reshape(batch * positions, vocab)
    dummy_ids = torch.zeros(batch * positions, 1, dtype=torch.long, device=logits.device)
    return processors(dummy_ids, flat).view(batch, positions, vocab)


def _forward(model, cache: RaggedCache, tokens: torch.Tensor) -> torch.Tensor:
    """Run ``tokens`` (B, m) after each row's valid cache entries; returns (B, m, V) logits."""
    m = tokens.shape[1]
    out = model(
        input_ids=tokens,
        attention_mask=cache.attention_mask(m),
        position_ids=cache.position_ids(m),
        **{CACHE: cache.cache},
        use_cache=True,
    )
    return out.logits


def speculative_generate(
    model, draft_model, input_ids: torch.Tensor, processors, generation_config, model_kwargs: dict[str, Any]
) -> torch.Tensor:
    """The loop described in the module docstring; returns ``sequences`` as regular decoding would."""
    from transformers import DynamicCache

    started = time.perf_counter()
    device = input_ids.device
    batch, prompt_width = input_ids.shape
    do_sample = bool(generation_config.do_sample)
    max_new = generation_config.max_length - prompt_width
    eos = generation_config._eos_token_tensor
    pad = generation_config._pad_token_tensor
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    real = mask.long().sum(-1)
    if draft_model is not None:
        schedule = DraftLength.from_config(generation_config, draft_model.generation_config)
    else:
        schedule = DraftLength(schedule="constant", length=int(generation_config.prompt_lookup_num_tokens))
    max_ngram = generation_config.max_matching_ngram_size or 2

    # Output buffer: the left-padded prompt, then each row's generated tokens at its own columns. A step
    # writes k + 1 <= max_new tokens after at most max_new - 1, so 2 * max_new columns never overflow.
    out = torch.full((batch, prompt_width + 2 * max_new + 1), int(pad) if pad is not None else 0, device=device)
    out[:, :prompt_width] = input_ids
    generated = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # original row of each active row

    def emit(new_tokens: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Write ``count[b]`` of ``new_tokens[b]`` into the active rows; returns the rows now finished."""
        cols = prompt_width + generated[rows][:, None] + torch.arange(new_tokens.shape[1], device=device)
        keep = torch.arange(new_tokens.shape[1], device=device) < count[:, None]
        current = out[rows[:, None], cols]
        out[rows[:, None], cols] = torch.where(keep, new_tokens, current)
        generated[rows] += count
        done = generated[rows] >= max_new
        if eos is not None:
            done |= (torch.isin(new_tokens, eos) & keep).any(-1)
        return done

    def truncate(new_tokens: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Cap each row's new tokens at its length budget and just after its first EOS."""
        count = torch.minimum(count, max_new - generated[rows])
        if eos is not None:
            is_eos = torch.isin(new_tokens, eos)
            first = torch.where(is_eos.any(-1), is_eos.long().argmax(-1) + 1, new_tokens.shape[1])
            count = torch.minimum(count, first)
        return count

    def pick(scores: torch.Tensor) -> torch.Tensor:
        """(B, P, V) scores -> (B, P) tokens: argmax, or one sample per position."""
        if do_sample:
            probs = scores.softmax(-1)
            return torch.multinomial(probs.flatten(0, 1), 1).view(scores.shape[:2])
        return scores.argmax(-1)

    # 1. Prefill: the main model sees the prompt as in regular decoding and picks the first token.
    main = RaggedCache(DynamicCache(config=model.config), real)
    logits = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        **{CACHE: main.cache},
        use_cache=True,
        logits_to_keep=1,
    ).logits
    main.lengths = real.clone()
    first = pick(_scores(processors, logits[:, -1:]))[:, 0]
    done = emit(first[:, None], torch.ones(batch, dtype=torch.long, device=device))
    # The draft cache holds all tokens but the last two; each draft step starts by feeding those two.
    draft = None
    if draft_model is not None:
        draft = RaggedCache(DynamicCache(config=draft_model.config), (real - 1).clamp(min=0))
        if prompt_width > 1:
            draft_model(
                input_ids=input_ids[:, :-1],
                attention_mask=mask[:, :-1],
                position_ids=position_ids[:, :-1],
                **{CACHE: draft.cache},
                use_cache=True,
                logits_to_keep=1,
            )

    stats: dict[str, Any] = {"steps": 0, "drafted": 0, "accepted": 0, "draft_forwards": 0, "row_steps": 0}
    finished_s = torch.zeros(batch, dtype=torch.float64)  # when each row left the batch (seconds into the loop)
    finished_s[done.cpu()] = time.perf_counter() - started
    last_stats.clear()
    while True:
        alive = ~done
        if not bool(alive.any()):
            break
        if not bool(alive.all()):
            keep_rows = alive.nonzero().squeeze(-1)
            zero = torch.zeros(len(rows), dtype=torch.long, device=device)
            main.commit(zero, 0, keep_rows)
            if draft is not None:
                draft.commit(zero, 0, keep_rows)
            rows = rows[keep_rows]
        active = len(rows)
        ends = prompt_width + generated[rows]  # first free column of each active row
        budget = int((max_new - generated[rows]).max())
        k = max(0, min(schedule.length, budget - 1))

        # 2. Drafts.
        draft_probs = None
        draft_lengths = None
        if k == 0:
            drafts = out.new_zeros(active, 0)
        elif draft is not None:
            last_two = out[rows[:, None], ends[:, None] - 2 + torch.arange(2, device=device)]
            step_input, proposed, q_scores = last_two, [], []
            for _ in range(k):
                scores = _scores(processors, _forward(draft_model, draft, step_input)[:, -1:])
                draft.lengths = draft.lengths + step_input.shape[1]
                token = pick(scores)
                proposed.append(token)
                q_scores.append(scores)
                step_input = token
            # lengths were advanced for the forward passes; commit() below counts from the pre-step lengths
            draft.lengths = draft.lengths - (k + 1)
            drafts = torch.cat(proposed, dim=1)
            if do_sample:
                draft_probs = torch.cat(q_scores, dim=1).softmax(-1)
        else:
            starts = prompt_width - real[rows]
            drafts, draft_lengths = prompt_lookup_drafts(out[rows], starts, ends, k, max_ngram)

        # 3. One forward of the main model over [last token, drafts].
        last = out[rows, ends - 1][:, None]
        scores = _scores(processors, _forward(model, main, torch.cat([last, drafts], dim=1)))

        # 4. Per-row acceptance.
        if not do_sample:
            n, new_tokens = greedy_accept(drafts, scores, draft_lengths)
        elif draft_probs is not None:
            n, new_tokens = speculative_sampling_accept(drafts, draft_probs, scores.softmax(-1))
        else:
            n, new_tokens = sampled_match_accept(drafts, scores.softmax(-1), draft_lengths)
        count = truncate(new_tokens, n + 1)
        stats["steps"] += 1
        stats["row_steps"] += active
        stats["drafted"] += k * active if draft_lengths is None else int(draft_lengths.sum())
        stats["accepted"] += int(n.sum())
        stats["draft_forwards"] += k if draft is not None else 0
        schedule.update(k, int(n.max()))
        done = emit(new_tokens, count)
        finished_s[rows[done].cpu()] = time.perf_counter() - started

        # 5. Caches keep the accepted entries: main holds all tokens but the last, the draft all but two.
        main.commit(count, k + 1)
        if draft is not None and k > 0:
            draft.commit(count, k + 1)

    last_stats.update(stats, row_finished_s=finished_s.tolist())
    total = prompt_width + int(generated.max())
    return out[:, :total]
