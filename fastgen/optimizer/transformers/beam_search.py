"""fastgen's own ``GenerationMixin._beam_search`` (feature ``beam``).

What changes against HF 5.23's loop, and why the outputs stay token-identical:
- Steps b–c (normalise, process, add the running scores, top-k over M·V) run as one
  :mod:`fastgen.ops.beam_topk` step on one N×V buffer: no float32 copy of the logits, no copy per
  logits processor, no N×V temporary for the add. On CPU these are upstream's own ops in upstream's
  order (bit-identical values, ``torch.topk`` itself picks), so every later step sees equal inputs.
- The supported processors are mask-type and applied in place on that buffer, in list order: no-repeat
  n-grams through :func:`fastgen.ops.ngram.ban_repeated_ngrams`, encoder n-grams through
  :func:`~fastgen.ops.ngram.ban_encoder_ngrams` (needs the ``ngram`` feature's prompt snapshot),
  min length / min new tokens (an EOS ban), single-token bad words, suppressed tokens (also at the
  beginning), forced BOS / EOS.
- Steps c–f (continuations, stopping criteria, running and finished beams) do upstream's arithmetic
  in upstream's order but gather only the first ``cur_len + 1`` positions of the sequence buffers
  (past them every row holds the fill value); the early-stop heuristic, the stop check and the
  cache reorder call upstream's own helpers.
- Finished inputs leave the batch (Amun's shrinking mini-batch) once upstream's own state says their
  results are frozen (early-stop heuristic unsatisfiable, or all beams finished with
  ``early_stopping=True``): their rows of every running tensor, ``model_kwargs`` and the cache go,
  and results are written back in input order. Needs outputs that frozen inputs cannot change
  (``return_dict_in_generate=False``, or a dict without ``output_scores`` and without a cache, i.e.
  ``use_cache=False``: upstream's per-step scores, which also bring ``sequences_scores``, and its
  returned cache hold the frozen inputs' later steps, which nobody computes once they left) and
  upstream's plain ``DynamicCache`` / ``EncoderDecoderCache`` (dynamic or sliding-window layers) or
  a cache with the :data:`INPUT_SELECT` method (fastgen's dedup caches have it: their shared
  cross-attention / prompt rows follow the inputs and stay shared); otherwise every input stays,
  as upstream.

Anything else goes to the original ``_beam_search`` for the whole call, with one warning naming
the argument: sampled beam search, ``synced_gpus``, ``low_memory``, ``output_logits`` /
``output_attentions`` / ``output_hidden_states``, any other logits processor (value-changing ones,
custom ones, multi-token bad words, ...) or stopping criterion.

The step outside the forward runs a fixed set of ops whatever B and M are and reads nothing back to
the host (ban ids go to the device once per call), except the stop check: one ``tolist()`` of a
B-element flag every ``k`` steps (``FASTGEN_BEAM_STOP_CHECK_EVERY``; default 4 on accelerators, 1 on
CPU where a check costs nothing), from which finished inputs also leave the batch, when the outputs
show nothing of the steps past an input's freeze; the length limit is checked on the host every
step. With per-step scores or a returned cache it is upstream's check, every step. (The CPU n-gram op
gathers its few matches with ``nonzero``, free on CPU; on a GPU it takes its fixed-shape path.)

Not done (issue 8): the loop is not wired to the fused GPU kernels of :mod:`fastgen.ops.beam_topk`.
It uses the exact torch path, because the kernels' values differ from upstream's by a few ulps and
their tie order is their own, which a token-identical contract cannot accept without a GPU to show
that the difference never flips a choice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import (
    ALL_CACHE_NAMES,
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
)

from fastgen import _env
from fastgen.models._caches import hypothesis_rows
from fastgen.models.growing_cache import GrowingLayer
from fastgen.ops import cpu_kernels
from fastgen.ops.beam_topk import approximate_top_k, log_probs_top_k
from fastgen.ops.ngram import ban_encoder_ngrams, ban_repeated_ngrams
from fastgen.optimizer import report
from fastgen.optimizer.registry import fallback, feature_enabled
from fastgen.optimizer.transformers import ngram as ngram_patches
from fastgen.optimizer.transformers.compiled_beam import CompiledBeamStep, beam_update
from fastgen.optimizer.transformers.contract import CACHE

FEATURE = "beam"
_PROCESSORS = (
    NoRepeatNGramLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    EncoderNoRepeatNGramLogitsProcessor,
    NoBadWordsLogitsProcessor,
)
_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


def _processor_problem(processor: Any, vocab: int | None) -> str | None:
    """Why a supported processor type cannot run in place here (its arguments), or None."""
    name = type(processor).__name__
    if type(processor) is NoBadWordsLogitsProcessor:
        words = list(processor.sequence_bias)
        if any(len(word) != 1 for word in words):
            return f"{name} with multi-token bad words"
        if vocab is None or any(not 0 <= word[0] < vocab for word in words):
            return f"{name} with ids outside the vocabulary (upstream raises)"
    if type(processor) is EncoderNoRepeatNGramLogitsProcessor:
        snapshot = getattr(processor, ngram_patches._SNAPSHOT, None)
        if snapshot is None:
            return f"{name} built without fastgen's ngram feature (no prompt snapshot)"
        if snapshot.ngram_size != processor.ngram_size or snapshot.ids.shape[0] != processor.batch_size:
            return f"{name} changed after construction"
        if vocab is None or snapshot.low < 0 or snapshot.high >= vocab:
            return f"{name} with prompt ids outside the vocabulary (upstream raises or wraps them)"
    return None


def unsupported_reason(
    generation_config: Any, logits_processor: Any, stopping_criteria: Any, synced_gpus: bool, vocab: int | None = None
):
    """Why this call must run upstream's loop, naming the argument; None when fastgen's loop serves it."""
    if synced_gpus:
        return "synced_gpus=True"
    if generation_config.do_sample:
        return "do_sample=True (sampled beam search)"
    if getattr(generation_config, "low_memory", None):
        return "low_memory=True"
    for flag in ("output_logits", "output_attentions", "output_hidden_states"):
        if generation_config.return_dict_in_generate and getattr(generation_config, flag, False):
            return f"{flag}=True"
    for processor in logits_processor or ():
        if type(processor) not in _PROCESSORS:  # exact types: a subclass may change values
            return f"logits processor {type(processor).__name__}"
        problem = _processor_problem(processor, vocab)
        if problem is not None:
            return problem
    for criterion in stopping_criteria or ():
        if type(criterion) not in _CRITERIA:
            return f"stopping criterion {type(criterion).__name__}"
    return None


def _prepare_processors(processors: Any, vocab: int, device: torch.device) -> list[tuple[Any, torch.Tensor | None]]:
    """Each supported processor with what it writes, on the device once per call (not once per step,
    which would copy host lists to the device and filter ids with a sync every step): the token ids it
    bans (ids outside [0, V) dropped, as upstream's ``isin`` over ``arange(V)`` ignores them), or for the
    encoder n-gram ban the prompts."""
    prepared: list[tuple[Any, torch.Tensor | None]] = []
    for processor in processors or ():
        kind, ids = type(processor), None
        if kind in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor):
            ids = processor.eos_token_id
        elif kind is SuppressTokensLogitsProcessor:
            ids = processor.suppress_tokens
        elif kind is SuppressTokensAtBeginLogitsProcessor:
            ids = processor.begin_suppress_tokens
        elif kind is NoBadWordsLogitsProcessor:  # single tokens only (checked): upstream adds a -inf bias
            ids = [word[0] for word in processor.sequence_bias]
        if ids is not None:
            listed = torch.as_tensor(ids).reshape(-1).tolist()
            ids = torch.tensor([i for i in listed if 0 <= i < vocab], dtype=torch.long, device=device)
        elif kind is EncoderNoRepeatNGramLogitsProcessor:
            ids = getattr(processor, ngram_patches._SNAPSHOT).ids.to(device)
        prepared.append((processor, ids))
    return prepared


def _writes(processor: Any, length: int) -> bool:
    """Whether ``processor`` changes the log-probs of a step at this sequence length (upstream's condition)."""
    kind = type(processor)
    if kind is MinLengthLogitsProcessor:
        return length < processor.min_length
    if kind is MinNewTokensLengthLogitsProcessor:
        return length - processor.prompt_length_to_skip < processor.min_new_tokens
    if kind is ForcedBOSTokenLogitsProcessor:
        return length == 1
    if kind is ForcedEOSTokenLogitsProcessor:
        return length == processor.max_length - 1
    if kind is SuppressTokensAtBeginLogitsProcessor:
        return length == processor.begin_index
    return True  # n-gram bans, suppressed tokens, single-token bad words: every step


def _apply_processors(
    processors: list[tuple[Any, torch.Tensor | None]],
    sequences: torch.Tensor,
    log_probs: torch.Tensor,
    active: torch.Tensor,
) -> None:
    """The supported processors (:func:`_prepare_processors`), in list order, in place on the loop's own
    buffer, with no host sync.

    Each one writes what upstream's returns (``-inf`` bans; a forced step: ``-inf`` everywhere and 0
    at the forced ids), under upstream's condition on the current length (:func:`_writes`).
    """
    length = sequences.shape[-1]
    neg_inf = float("-inf")
    for processor, ids in processors:
        if not _writes(processor, length):
            continue
        kind = type(processor)
        if kind is NoRepeatNGramLogitsProcessor:
            ban_repeated_ngrams(sequences, log_probs, processor.ngram_size)
        elif kind in (ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor):
            forced = processor.bos_token_id if kind is ForcedBOSTokenLogitsProcessor else processor.eos_token_id
            log_probs.fill_(neg_inf)
            log_probs[:, forced] = 0
        elif kind is EncoderNoRepeatNGramLogitsProcessor:  # the prompts of the inputs still in the batch
            ban_encoder_ngrams(ids.index_select(0, active), sequences, log_probs, processor.ngram_size)
        else:  # min length, min new tokens, suppressed tokens (at the beginning too), bad words: bans
            log_probs.index_fill_(1, ids, neg_inf)


def _note_ngram_bans(processors: Any) -> None:
    """The loop bans n-grams with fastgen's n-gram op itself (not through the processors' patched
    ``__call__``): say so under the ``ngram`` feature when it is on, as its processors would."""
    owner = ngram_patches.FEATURE if feature_enabled(ngram_patches.FEATURE) else FEATURE
    for processor in processors or ():
        if type(processor) is NoRepeatNGramLogitsProcessor:
            report.note_ran(owner, ngram_patches.RAN_NO_REPEAT)
        elif type(processor) is EncoderNoRepeatNGramLogitsProcessor:
            report.note_ran(owner, ngram_patches.RAN_ENCODER_NO_REPEAT)


def _is_plain_dynamic(cache: Any) -> bool:
    """Upstream's default caches, whose rows are exactly the B·M hypotheses (fastgen's dedup caches are not)."""
    if type(cache) is EncoderDecoderCache:
        return _is_plain_dynamic(cache.self_attention_cache) and _is_plain_dynamic(cache.cross_attention_cache)
    return type(cache) is DynamicCache and all(
        type(layer) in _PLAIN_LAYERS or getattr(layer, "rows_are_hypotheses", False) for layer in cache.layers
    )


#: upstream's dynamic layers whose only per-row state is K/V (a sliding window's length is per cache)
_PLAIN_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer)  # the last: the lean step's, per call


#: the method a cache that is not upstream's plain one provides so that finished inputs can leave the
#: batch: ``cache.batch_select_inputs(keep, beams)`` keeps inputs ``keep`` (int64 indices into the
#: current inputs, ascending) with their ``beams`` consecutive hypothesis rows each, in place, and
#: keeps any per-input sharing (one cross-attention / prompt row per input) intact.
INPUT_SELECT = "batch_select_inputs"

#: model_kwargs entries the loop knows how to shrink with the batch (tensors of any other key: keep all rows)
_SELECTABLE = {"attention_mask", "decoder_attention_mask", "encoder_outputs", "position_ids"}
_IGNORED = {"cache_position", *ALL_CACHE_NAMES}


def _removal_problem(model_kwargs: dict[str, Any]) -> str | None:
    """Why finished inputs cannot leave the batch in this call (None: they can)."""
    for key, value in model_kwargs.items():
        if key in _SELECTABLE or key in _IGNORED:
            continue
        if isinstance(value, torch.Tensor) or hasattr(value, "keys"):
            return f"model kwarg {key!r}"
    cache = next((model_kwargs[key] for key in ALL_CACHE_NAMES if key in model_kwargs), None)
    if cache is not None and not _is_plain_dynamic(cache) and not callable(getattr(cache, INPUT_SELECT, None)):
        # a cache keeping one row per input for shared K/V (fastgen's dedup caches) would be un-shared by
        # batch_select_indices (per-row copies): it needs the input-group select.
        return f"cache {type(cache).__name__} has no input-group select ({INPUT_SELECT})"
    return None


#: environment variable: decoding steps between two stop checks (host syncs) of fastgen's loop
STOP_CHECK_ENV = "FASTGEN_BEAM_STOP_CHECK_EVERY"
#: default on accelerators, where each check waits for the device; on CPU a check costs nothing and
#: every step past a freeze costs a decoder step, so the CPU default is every step
DEFAULT_STOP_CHECK_EVERY = 4


def stop_check_interval(device: torch.device | str = "cuda") -> int:
    """Steps between stop checks: :data:`STOP_CHECK_ENV` if set (a positive integer), else 1 on CPU, 4 elsewhere."""
    value = os.environ.get(STOP_CHECK_ENV, "").strip()
    if not value:
        return 1 if torch.device(device).type == "cpu" else DEFAULT_STOP_CHECK_EVERY
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{STOP_CHECK_ENV} must be a positive integer, got {value!r}")
    return int(value)


def _outputs_need_every_input(generation_config: Any, model_kwargs: dict[str, Any]) -> bool:
    """Whether the returned outputs hold what a frozen input computes after it froze.

    Upstream keeps decoding frozen inputs to the end: ``output_scores`` returns their per-step scores
    (and is what brings ``sequences_scores``), and a returned cache holds their K/V of every step.
    Sequences and ``beam_indices`` are frozen with the input, so a dict without either can drop them.
    """
    if not generation_config.return_dict_in_generate:
        return False
    if generation_config.output_scores:
        return True
    has_cache = any(model_kwargs.get(key) is not None for key in ALL_CACHE_NAMES)
    return has_cache or model_kwargs.get("use_cache") is not False


def _select_rows(value: Any, hyp_rows: torch.Tensor, input_rows: torch.Tensor, batch: int, beams: int) -> Any:
    """Keep the surviving inputs' rows: hypothesis-major tensors (B·M rows) or per-input ones (B rows)."""
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == batch * beams:
            return value.index_select(0, hyp_rows.to(value.device))
        if value.dim() and value.shape[0] == batch:
            return value.index_select(0, input_rows.to(value.device))
        return value
    if hasattr(value, "keys"):  # ModelOutput (encoder_outputs) or dict
        for key in list(value.keys()):
            value[key] = _select_rows(value[key], hyp_rows, input_rows, batch, beams)
        return value
    if isinstance(value, tuple):
        return tuple(_select_rows(v, hyp_rows, input_rows, batch, beams) for v in value)
    return value


def _drop_inputs(model_kwargs: dict[str, Any], keep: torch.Tensor, batch: int, beams: int) -> None:
    """Shrink model_kwargs and the cache to the inputs in ``keep`` (local indices), in place."""
    hyp_rows = hypothesis_rows(keep, beams)
    for key in list(model_kwargs):
        if key in _SELECTABLE:
            model_kwargs[key] = _select_rows(model_kwargs[key], hyp_rows, keep, batch, beams)
        elif key in ALL_CACHE_NAMES and model_kwargs[key] is not None:
            cache = model_kwargs[key]
            if _is_plain_dynamic(cache):
                cache.batch_select_indices(hyp_rows)
            else:
                getattr(cache, INPUT_SELECT)(keep, beams)


LEAN_ENV = "FASTGEN_LEAN_STEP"


def lean_step_switched_off() -> bool:
    """``FASTGEN_LEAN_STEP=0`` (or false/off/no): every decode step runs the model's own forward."""
    return _env.switched_off(LEAN_ENV)


NATIVE_ENV = "FASTGEN_NATIVE_BEAM"


def _native_update(stopping_criteria: Any, device: torch.device) -> tuple[torch.Tensor | None, int] | None:
    """(end-of-sequence ids, length limit) where ``fastgen_cpu::beam_update_`` can run this call's steps c-f
    (upstream's bits, one call instead of ~40 small ops), else None: on a GPU, without fastgen's CPU kernels
    (never built for this), with ``FASTGEN_NATIVE_BEAM=0``, or where a length criterion could warn about the
    model's position limit (upstream's criteria then run as written)."""
    if device.type != "cpu" or _env.switched_off(NATIVE_ENV):
        return None
    if not cpu_kernels.available(build=False) or not hasattr(torch.ops.fastgen_cpu, "beam_update_"):
        return None
    eos, limits = [], []
    for criterion in stopping_criteria or ():
        if type(criterion) is MaxLengthCriteria:
            positions = criterion.max_position_embeddings
            if positions is not None and criterion.max_length > positions:
                return None
            limits.append(criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos.append(criterion.eos_token_id.reshape(-1).to(device=device, dtype=torch.long))
        else:
            return None
    return (torch.cat(eos) if eos else None), min(limits, default=2**62)


def _approximate_scores(model: Any, all_scores: Any) -> bool:
    """Whether this call's beam steps may take their candidates straight from the logits
    (:func:`fastgen.ops.beam_topk.approximate_top_k`; each step where no processor writes into the
    log-probs): the LM head runs in ``fast_gemm`` or ``int8`` on this thread (the user asked for approximate
    arithmetic; its logits are not upstream's bits anyway) and the caller asked for no per-step scores."""
    from fastgen.optimizer import linear_modes  # imports this package's registry at its import

    head = model.get_output_embeddings()
    return all_scores is None and head is not None and linear_modes.approximate_linear(head)


class _StepOutputs(dict):
    """What the loop reads of a forward's outputs (``.logits``, and the cache for the model kwargs)."""

    def __init__(self, logits: torch.Tensor, cache: Any) -> None:
        super().__init__({CACHE: cache})
        self.logits = logits


def _lean_step(model: Any, length_limit: int, beams: int = 1) -> Any:
    """The lean decode step (:class:`fastgen.models.lean_step.LeanDecodeStep`; for a decoder-only model on a GPU
    :class:`fastgen.models.decoder_graph_step.DecoderGraphStep`) for this call's model, or None where upstream's
    forward runs every step (``FASTGEN_LEAN_STEP=0``, or a model it does not reproduce: noted in the report)."""
    # Imported here: at this module's import it would import transformers.modeling_utils, whose import
    # hooks load other features' factories that import this (then partial) module.
    from fastgen.models import lean_step

    if lean_step_switched_off():
        return None
    if not model.config.is_encoder_decoder:  # a decoder-only model: its own forward on static buffers, on a GPU
        from fastgen.models import decoder_graph_step

        return decoder_graph_step.decode_step(model, length_limit, beams)
    reason = lean_step.model_problem(model)
    if reason is not None:
        report.note_ran(FEATURE, f"decode step: upstream's forward ({reason})")
        return None
    report.note_ran(FEATURE, "decode step: the lean BART-family step")
    return lean_step.LeanDecodeStep(model, length_limit)


def _first_step_through(model: Any, lean: Any) -> Any:
    """The prefill's forward through the lean step (which takes a call's first decode step when its inputs are
    what it reproduces), where no instance forward is on the model already."""
    if lean is None or "forward" in model.__dict__:
        return contextlib.nullcontext()
    from fastgen.optimizer.transformers.lean_sample import _forward_through  # that module imports this one

    return _forward_through(model, lean, finish=False)


def other_device_reason(input_ids: torch.Tensor, model: Any) -> str | None:
    """Upstream (5.24) lets the inputs stay on another device than the model and moves each step's
    model inputs; fastgen's loops keep every tensor on one device, so such a call runs upstream's."""
    device = getattr(model, "device", None)
    if device is None or device.type == "meta" or input_ids.device == device:
        return None
    return f"input_ids on {input_ids.device}, model on {device}"


def make_beam_search(original: Callable[..., Any]) -> Callable[..., Any]:
    def beam_search(
        self,
        input_ids: torch.LongTensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> Any:
        head = self.get_output_embeddings() if hasattr(self, "get_output_embeddings") else None
        vocab = getattr(head, "out_features", None)
        reason = unsupported_reason(generation_config, logits_processor, stopping_criteria, synced_gpus, vocab)
        if reason is None:
            reason = other_device_reason(input_ids, self)
        if reason is not None:
            fallback(FEATURE, reason)
            return original(
                self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **model_kwargs
            )
        report.note_ran(FEATURE, "fastgen's beam search loop")
        _note_ngram_bans(logits_processor)
        return _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    return beam_search


def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """HF 5.23 ``_beam_search`` with steps b–c replaced (module doc); comments name upstream's steps."""
    pad_token_id = generation_config._pad_token_tensor
    eos_token_id = generation_config._eos_token_tensor
    return_dict_in_generate = generation_config.return_dict_in_generate
    output_scores = generation_config.output_scores
    early_stopping = generation_config.early_stopping
    length_penalty = generation_config.length_penalty
    max_length = generation_config.max_length
    num_beams = generation_config.num_beams
    num_return_sequences = generation_config.num_return_sequences

    batch_size_unflattened, cur_len = input_ids.shape[:2]
    batch_size = batch_size_unflattened // num_beams
    decoder_prompt_len = cur_len
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams
    top_num_beam_mask = torch.cat(
        (torch.ones((num_beams), dtype=torch.bool), torch.zeros((beams_to_keep - num_beams), dtype=torch.bool)), dim=0
    ).to(input_ids.device)
    all_scores = () if (return_dict_in_generate and output_scores) else None

    # 3. running tensors (as upstream)
    output_fill_value = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
    running_sequences = torch.full(
        (batch_size, num_beams, max_length), fill_value=output_fill_value, dtype=torch.int64, device=input_ids.device
    )
    running_sequences[:, :, :cur_len] = self._unflatten_beam_dim(input_ids, batch_size, num_beams)
    sequences = running_sequences.detach().clone()
    running_beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float, device=input_ids.device)
    running_beam_scores[:, 1:] = -1e9
    beam_scores = torch.full((batch_size, num_beams), fill_value=-1e9, dtype=torch.float, device=input_ids.device)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=input_ids.device)
    is_early_stop_heuristic_unsatisfied = torch.ones((batch_size, 1), dtype=torch.bool, device=input_ids.device)
    next_token_hits_stopping_criteria = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=input_ids.device)
    running_beam_indices = torch.full(
        (batch_size, num_beams, max_length - cur_len), fill_value=-1, dtype=torch.int32, device=input_ids.device
    )
    beam_indices = running_beam_indices.detach().clone()

    # Finished inputs leave the batch (their rows of every per-input tensor, model_kwargs and the
    # cache) once their results cannot change; results are written back in input order at the end.
    # Off when something in model_kwargs cannot be shrunk, and when the outputs would show the frozen
    # inputs' later steps (see _outputs_need_every_input); in that case the stop check is upstream's,
    # every step. Otherwise it runs every check_every steps only (one host sync each): steps past the
    # last input's freeze change nothing the caller gets.
    lazy_stop = not _outputs_need_every_input(generation_config, model_kwargs)
    removal = lazy_stop and _removal_problem(model_kwargs) is None
    check_every = stop_check_interval(input_ids.device)
    length_limit = min([max_length] + [c.max_length for c in stopping_criteria or () if type(c) is MaxLengthCriteria])
    active = torch.arange(batch_size, device=input_ids.device)  # original index of each current input
    final_sequences, final_scores, final_indices = sequences.clone(), beam_scores.clone(), beam_indices.clone()

    flat_running_sequences = input_ids
    processors = None  # prepared at the first step, when V is known
    fused = False  # the approximate modes' fused log-softmax and top-k (decided with the processors)
    native = _native_update(stopping_criteria, input_ids.device)
    stopping = {True: 1, False: 0, "never": 2}.get(early_stopping)
    if stopping is None:
        native = None
    if native is not None:
        report.note_ran(FEATURE, "beam bookkeeping: C++ (fastgen_cpu.beam_update_)")
        native_settings = (*native, decoder_prompt_len, max_length, float(length_penalty), stopping)
    lean = _lean_step(self, length_limit, num_beams)
    prefill_consumed = False
    this_peer_finished = False
    with _first_step_through(self, lean):
        model_outputs = self._prefill(
            input_ids, generation_config, model_kwargs, is_first_iteration=not generation_config.is_assistant
        )

    # 4. the loop
    fast: CompiledBeamStep | None = None  # the batch's later steps as four native calls (compiled_beam)

    def beam_state() -> tuple[torch.Tensor, ...]:
        """The tensors ``beam_update_`` updates in place after the running sequences (compiled_beam.beam_update)."""
        running = (running_beam_scores, running_beam_indices, sequences, beam_scores, beam_indices)
        return (*running, is_sent_finished, is_early_stop_heuristic_unsatisfied)

    def short_way() -> CompiledBeamStep | None:
        """The compiled beam step for the next steps where the lean step would run them in its C++ program (asked
        with the model inputs the next step would get), after the first step and after inputs left the batch."""
        model_inputs = self.prepare_inputs_for_generation(
            self._flatten_beam_dim(running_sequences[:, :, :cur_len]),
            next_sequence_length=1 if model_kwargs["use_cache"] else None,
            **model_kwargs,
        )
        if not lean.compiled_ready(model_inputs):
            return None
        return CompiledBeamStep.after(self, lean, model_kwargs, batch_size * num_beams, beams_to_keep, native_settings)

    while self._has_unfinished_sequences(this_peer_finished, False, device=input_ids.device):
        whole_step = False
        first_step = not prefill_consumed
        if fast is not None and not any(_writes(processor, cur_len) for processor, _ in processors):
            logits = fast.step(running_sequences, cur_len, beam_state(), active)
            whole_step = logits is None
            if not whole_step:  # the fused candidates refused these logits: the long way from them
                flat_running_sequences = self._flatten_beam_dim(running_sequences[:, :, :cur_len])
                model_outputs = _StepOutputs(logits=logits, cache=fast.cache)
        elif prefill_consumed:
            flat_running_sequences = self._flatten_beam_dim(running_sequences[:, :, :cur_len])
            next_sequence_length = 1 if model_kwargs["use_cache"] else None
            model_inputs = self.prepare_inputs_for_generation(
                flat_running_sequences, next_sequence_length=next_sequence_length, **model_kwargs
            )
            stepped = lean.step(model_inputs) if lean is not None else None
            if stepped is None:
                model_outputs = self(**model_inputs, return_dict=True)
            else:
                model_outputs = _StepOutputs(logits=stepped[0], cache=stepped[1])
        if not whole_step:
            prefill_consumed = True
            model_kwargs = self._update_model_kwargs_for_generation(
                model_outputs, model_kwargs, is_encoder_decoder=self.config.is_encoder_decoder
            )

            # b–c. one buffer: log_softmax (float32, as upstream), bans in place, + scores, top-k over M·V
            logits = model_outputs.logits[:, -1, :].to(dtype=torch.float32, device=input_ids.device)
            del model_outputs
            if processors is None:
                processors = _prepare_processors(logits_processor, logits.shape[-1], logits.device)
                fused = _approximate_scores(self, all_scores)
            step = None
            if fused and not any(_writes(processor, flat_running_sequences.shape[-1]) for processor, _ in processors):
                step = approximate_top_k(logits, running_beam_scores, beams_to_keep)
                if step is not None:
                    report.note_ran(FEATURE, "beam scores: log-softmax and top-k fused (approximate mode, C++)")
            step_fused = step is not None
            if step is None:
                log_probs = torch.log_softmax(logits, dim=-1)
                del logits
                _apply_processors(processors, flat_running_sequences, log_probs, active)
                if all_scores is not None:
                    all_scores += (log_probs.clone(),)
                step = log_probs_top_k(log_probs, running_beam_scores, beams_to_keep)
            if native is not None:  # steps c-f in one call, in place; upstream's bits (csrc/cpu/beam_update.cpp)
                beam_idx, next_token_hits_stopping_criteria = beam_update(
                    native_settings, step, running_sequences, beam_state(), cur_len, active
                )
            else:
                topk_log_probs = step.scores
                # c–f on the first cur_len + 1 positions only: past them every row of every buffer still holds
                # its fill value, so upstream's whole-max_length gathers would move nothing else.
                length, generated = cur_len + 1, cur_len + 1 - decoder_prompt_len
                batch_offset = active.view(-1, 1) * num_beams  # upstream's batch index, whatever left the batch
                topk_sequences = torch.cat(
                    (self._gather_beams(running_sequences[:, :, :cur_len], step.beams), step.tokens.unsqueeze(-1)),
                    dim=-1,
                )
                topk_beam_indices = torch.cat(
                    (
                        self._gather_beams(running_beam_indices[:, :, : generated - 1], step.beams),
                        (step.beams + batch_offset).to(running_beam_indices.dtype).unsqueeze(-1),
                    ),
                    dim=-1,
                )
                next_token_hits_stopping_criteria = stopping_criteria(
                    self._flatten_beam_dim(topk_sequences), all_scores
                )
                next_token_hits_stopping_criteria = self._unflatten_beam_dim(
                    next_token_hits_stopping_criteria, batch_size, beams_to_keep
                )
                # e. as _get_running_beams_for_next_iteration
                topk_running_log_probs = topk_log_probs + next_token_hits_stopping_criteria.to(torch.float32) * -1.0e9
                next_topk_indices = torch.topk(topk_running_log_probs, k=num_beams)[1]
                running_sequences[:, :, :length] = self._gather_beams(topk_sequences, next_topk_indices)
                running_beam_scores = self._gather_beams(topk_running_log_probs, next_topk_indices)
                running_beam_indices[:, :, :generated] = self._gather_beams(topk_beam_indices, next_topk_indices)
                # f. as _update_finished_beams, same arithmetic in the same order
                did_top_num_beams_just_finished = next_token_hits_stopping_criteria & top_num_beam_mask[None, :]
                candidate_scores = topk_log_probs / (generated**length_penalty)
                beams_in_batch_are_full = torch.all(is_sent_finished, axis=-1, keepdims=True) & (early_stopping is True)
                candidate_scores += beams_in_batch_are_full.to(torch.float32) * -1.0e9
                candidate_scores += (~is_early_stop_heuristic_unsatisfied).to(torch.float32) * -1.0e9
                candidate_scores += (~did_top_num_beams_just_finished) * -1.0e9
                merged_scores = torch.cat((beam_scores, candidate_scores), dim=1)
                topk_merged_indices = torch.topk(merged_scores, k=num_beams)[1]
                merged_sequences = torch.cat((sequences[:, :, :length], topk_sequences), dim=1)
                sequences[:, :, :length] = self._gather_beams(merged_sequences, topk_merged_indices)
                merged_beam_indices = torch.cat((beam_indices[:, :, :generated], topk_beam_indices), dim=1)
                beam_indices[:, :, :generated] = self._gather_beams(merged_beam_indices, topk_merged_indices)
                beam_scores = self._gather_beams(merged_scores, topk_merged_indices)
                merged_is_sent_finished = torch.cat((is_sent_finished, did_top_num_beams_just_finished), dim=1)
                is_sent_finished = self._gather_beams(merged_is_sent_finished, topk_merged_indices)
            if any(cache_key in model_kwargs for cache_key in ALL_CACHE_NAMES):
                cache_key = next(cache_key for cache_key in ALL_CACHE_NAMES if cache_key in model_kwargs)
                if native is None:
                    beam_idx = running_beam_indices[..., cur_len - decoder_prompt_len]
                    if batch_size < len(final_scores):  # indices carry upstream's batch offsets; the cache is smaller
                        local = torch.arange(batch_size, device=active.device)
                        beam_idx = beam_idx - ((active - local) * num_beams).view(-1, 1).to(beam_idx.dtype)
                    beam_idx = self._flatten_beam_dim(beam_idx)
                if hasattr(self, "_reorder_cache"):
                    model_kwargs[cache_key] = self._reorder_cache(model_kwargs[cache_key], beam_idx)
                elif hasattr(model_kwargs[cache_key], "reorder_cache"):
                    model_kwargs[cache_key].reorder_cache(beam_idx)
                else:
                    raise ValueError(
                        f"{self.__class__.__name__} cannot use beam search with a cache currently, as the cache "
                        "cannot be reordered"
                    )
            cur_len = cur_len + 1
            if native is None:  # (the native update ran it already)
                is_early_stop_heuristic_unsatisfied = self._check_early_stop_heuristic(
                    is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
                    running_beam_scores=running_beam_scores,
                    beam_scores=beam_scores,
                    is_sent_finished=is_sent_finished,
                    cur_len=cur_len,
                    max_length=max_length,
                    decoder_prompt_len=decoder_prompt_len,
                    early_stopping=early_stopping,
                    length_penalty=length_penalty,
                )
            if not lazy_stop:  # the outputs show every step: upstream's check, every step
                this_peer_finished = not self._beam_search_has_unfinished_sequences(
                    is_early_stop_heuristic_unsatisfied,
                    is_sent_finished,
                    next_token_hits_stopping_criteria,
                    early_stopping,
                )
                continue
            if fast is None and step_fused and native is not None and lean is not None:
                if lean.ran_compiled:
                    fast = CompiledBeamStep.after(
                        self, lean, model_kwargs, len(beam_idx), beams_to_keep, native_settings
                    )
                elif first_step:
                    fast = short_way()
        else:
            cur_len = cur_len + 1
        # Upstream's third stop condition (every candidate hits a criterion) is the length limit: known
        # on the host. Its other two mean every input is done, which the check below sees within k steps.
        this_peer_finished = cur_len >= length_limit
        if this_peer_finished or (cur_len - decoder_prompt_len) % check_every:
            continue
        # An input whose heuristic says no improvement (or, with early_stopping=True, whose beams are
        # all finished) gets -1e9 on every later candidate in _update_finished_beams: it is frozen, so
        # the steps it takes until this check (as in upstream, where the batch goes on) change nothing.
        done = ~is_early_stop_heuristic_unsatisfied[:, 0]
        if early_stopping is True:
            done |= is_sent_finished.all(dim=1)
        done = done.tolist()  # the loop's one host sync, every check_every steps
        if all(done):
            this_peer_finished = True
        elif removal and any(done) and not (lean is not None and lean.keeps_rows(sum(done), batch_size)):
            gone = torch.tensor([i for i, d in enumerate(done) if d], device=active.device)
            keep = torch.tensor([i for i, d in enumerate(done) if not d], device=active.device)
            final_sequences[active[gone]] = sequences[gone]
            final_scores[active[gone]] = beam_scores[gone]
            final_indices[active[gone]] = beam_indices[gone]
            _drop_inputs(model_kwargs, keep, batch_size, num_beams)
            report.note_ran(FEATURE, "finished inputs left the batch")
            running_sequences, running_beam_scores = running_sequences[keep], running_beam_scores[keep]
            running_beam_indices, sequences = running_beam_indices[keep], sequences[keep]
            beam_scores, beam_indices, is_sent_finished = beam_scores[keep], beam_indices[keep], is_sent_finished[keep]
            is_early_stop_heuristic_unsatisfied = is_early_stop_heuristic_unsatisfied[keep]
            active, batch_size = active[keep], len(keep)
            if lean is not None:
                lean.keep_inputs(keep, len(done), model_kwargs.get("attention_mask"), batch_size * num_beams)
            if fast is not None:  # new rows, masks and cache tensors: the short way again where the lean step says so
                fast = short_way()

    final_sequences[active], final_scores[active], final_indices[active] = sequences, beam_scores, beam_indices
    if lean is not None:
        lean.finish()
    sequences, beam_scores, beam_indices = final_sequences, final_scores, final_indices

    # 5. outputs, as upstream
    sequences = self._flatten_beam_dim(sequences[:, :num_return_sequences, :])
    beam_scores = self._flatten_beam_dim(beam_scores[:, :num_return_sequences])
    beam_indices = self._flatten_beam_dim(beam_indices[:, :num_return_sequences, :])
    max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
    output_length = decoder_prompt_len + max_generated_length
    sequences = sequences[:, :output_length]
    beam_indices = beam_indices[:, :max_generated_length]
    if not return_dict_in_generate:
        return sequences
    if not output_scores:
        beam_scores = None
    cache = None
    if any(cache_key in model_kwargs for cache_key in ALL_CACHE_NAMES):
        cache = model_kwargs[next(cache_key for cache_key in ALL_CACHE_NAMES if cache_key in model_kwargs)]
    if self.config.is_encoder_decoder:
        return GenerateBeamEncoderDecoderOutput(
            sequences=sequences,
            sequences_scores=beam_scores,
            scores=all_scores,
            logits=None,
            beam_indices=beam_indices,
            encoder_attentions=None,  # output_attentions / output_hidden_states run upstream's loop
            encoder_hidden_states=None,
            decoder_attentions=None,
            cross_attentions=None,
            decoder_hidden_states=None,
            **{CACHE: cache},
        )
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=beam_scores,
        scores=all_scores,
        logits=None,
        beam_indices=beam_indices,
        attentions=None,
        hidden_states=None,
        **{CACHE: cache},
    )
