"""Transformers' names that fastgen relies on, resolved once for the installed release (DESIGN.md §9).

Features import names from here and never spell them, so an upstream rename is one change in this
file. The one rename so far: 5.24 called the cache ``cache`` where 5.18–5.23 said ``past_key_values``
(``generate``'s kwarg, ``model_kwargs``, every model's ``forward`` and every ``ModelOutput``).
:data:`CACHE` is that name, read from upstream's own structures rather than from a version number,
and :func:`problem` says, in words a user can act on, why fastgen's patches cannot run when the
installed release has a structure fastgen does not know. Patches declared with
``requires`` naming :func:`problem` are then skipped with that reason in ``status()``, never shown ``applied``.

Inventory of the upstream surface of the Transformers features. For each: the feature, public or
private (and why a private one stays), and the guard, the test that fails when it moves. Checked on
5.18.0, 5.23.0, 5.24.0 and 5.25.0; CI runs the whole suite on the newest release, the fast-path tests on
5.24 and the skip check on 5.15.1 (``scripts/test.sh``).

- The cache's name (:data:`CACHE`), all features. Renamed in 5.24; resolved here from
  ``generation.utils.ALL_CACHE_NAMES`` (private list) and the public output dataclasses, which must
  agree. Guard: ``tests/optimizer/test_contract.py`` and every fast-path test (``report()`` says ran).
- ``GenerationMixin.generate`` (public), dedup: folds a returned shared cache back to upstream's layout.
- ``GenerationMixin._expand_inputs_for_generation`` (private), dedup: the only place encoder outputs
  are repeated per beam; no public hook exists. Signature guarded by ``Patch.expects``.
- ``GenerationMixin._prepare_cache_for_generation`` (private), dedup: the one point that sees both the
  decoding mode and the fresh cache (a ``Cache`` subclass alone cannot refuse a mode). ``expects``.
- ``GenerationMixin._prefill`` (private), dedup: a decoder-only prompt prefilled at B rows. ``expects``.
- ``GenerationMixin._beam_search`` (private), beam: fastgen's own loop. ``custom_generate`` is the
  public alternative but needs the user to opt in per call, against "one import". ``expects``.
- ``GenerationMixin._sample`` (private), lean_step: wrapped, not replaced; for the call the model gets an
  instance ``forward`` that runs one-token decode steps through the lean step. It relies on the loop calling
  ``self.__call__`` with keyword model inputs and ``return_dict=True``, and reading ``.logits`` and the cache.
  ``expects``; guard: ``tests/optimizer/test_lean_sample.py`` (greedy and seeded sampling equal to upstream).
- The BART-family decoder's modules and attributes the lean step calls or reads (``embed_tokens`` and its
  ``embed_scale``, ``embed_positions`` and its ``offset``, the layers' norms, projections, ``activation_fn``,
  the attention modules' ``num_heads`` / ``head_dim`` / ``scaling``, ``final_logits_bias``; public modules,
  private attributes), lean_step and beam; admitted by exact class and Transformers release
  (``fastgen.models.lean_step.TESTED_TRANSFORMERS``). The compiled form of the step also recognises
  ``integrations.sdpa_attention.sdpa_attention_forward`` (public function) inside fastgen's attention
  wrappers, and calls SDPA as it does. The call's first step repeats what ``BartAttention`` does with an empty
  ``EncoderDecoderCache`` (``cross_attention_cache.update`` of the projected encoder states, then
  ``is_updated[layer] = True``); the beam loop's prefill reaches it through the same instance ``forward`` as
  ``_sample``. On a GPU the step's static form (``fastgen/models/graph_step.py``) reads the same modules and
  writes the self-attention buffers itself. Guard: ``tests/models/test_lean_step.py`` (the first step too),
  ``tests/models/test_compiled_step.py`` and ``tests/models/test_graph_step.py`` (bit-identical steps, the
  exact mode against upstream; the static step's tokens against upstream).
- ``GenerationMixin._assisted_decoding`` (private), speculative: upstream raises for batch > 1 inside
  it. ``expects``.
- ``AttentionInterface.get_interface`` (public registry class), dedup: wrapping the lookup rather than
  ``AttentionInterface.register`` keeps mask creation keyed on the stock name (see dedup.py).
- ``GenerationMixin`` helpers the beam loop calls so shapes and order equal upstream's (private):
  ``_flatten_beam_dim``, ``_unflatten_beam_dim``, ``_gather_beams``,
  ``_beam_search_has_unfinished_sequences``, ``_check_early_stop_heuristic``,
  ``_has_unfinished_sequences``, ``_reorder_cache``, ``_prefill``,
  ``_update_model_kwargs_for_generation``, ``prepare_inputs_for_generation``. Guard:
  ``tests/optimizer/test_beam_search.py`` (every case bit-identical to upstream's loop).
- ``generation.utils.ALL_CACHE_NAMES`` (private), beam: where a loop finds the cache in ``model_kwargs``.
- ``cache_utils.DynamicCache``, ``EncoderDecoderCache``, ``DynamicLayer``,
  ``DynamicSlidingWindowLayer`` and the layers' ``keys`` / ``values`` / ``is_initialized`` /
  ``lazy_initialization`` (public classes; fastgen subclasses them), dedup and beam. 5.24 dropped
  ``layer.dtype``, which fastgen never reads. Guard: ``tests/models/test_dedup_*``.
- ``NoRepeatNGramLogitsProcessor.__call__``, ``EncoderNoRepeatNGramLogitsProcessor`` (public
  ``LogitsProcessor`` classes), ngram: replaced in place so every loop, upstream's and fastgen's,
  runs the op. Guard: ``tests/optimizer/test_ngram_patches.py``.
- ``GenerationMixin._prepare_generation_config`` and ``GenerationConfig._get_default_generation_params``
  (private), continuous batching (``fastgen/continuous/settings.py``): the settings ``generate`` would use,
  so a call it does not serve falls back. Guard: ``tests/test_continuous_batching.py``.
- ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper`` (public,
  ``transformers.generation``), continuous sampling (``fastgen/continuous/search.py``) builds them as
  ``_get_logits_processor`` does. Guard: ``tests/test_continuous_sampling.py``.
- ``GenerationMode``, ``GenerateBeam*Output``, ``GenerateDecoderOnlyOutput`` (public), all.
"""

from __future__ import annotations

import dataclasses
import functools

#: The newest Transformers release the fast paths were tested on, named when a newer one differs.
NEWEST_TESTED = "5.25.0"

#: Cache names fastgen knows, newest first.
KNOWN_CACHE_NAMES = ("cache", "past_key_values")


def _installed_version() -> str:
    import transformers

    return transformers.__version__


def _output_cache_field() -> str | None:
    """The cache field that upstream's ``ModelOutput`` dataclasses (public classes) share."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, Seq2SeqLMOutput

    fields = [{f.name for f in dataclasses.fields(klass)} for klass in (CausalLMOutputWithPast, Seq2SeqLMOutput)]
    return next((name for name in KNOWN_CACHE_NAMES if all(name in each for each in fields)), None)


def _generation_cache_name() -> str | None:
    """The name ``generate`` keeps the cache under in ``model_kwargs`` (``ALL_CACHE_NAMES[0]``)."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", None)
    return names[0] if names and names[0] in KNOWN_CACHE_NAMES else None


@functools.cache
def _resolved() -> tuple[str | None, str | None]:
    """``(cache name, problem)``: the name when upstream's structures agree on a known one."""
    output, generation = _output_cache_field(), _generation_cache_name()
    if output is not None and output == generation:
        return output, None
    return None, (
        f"transformers {_installed_version()} is newer than fastgen knows (cache named {generation!r} in "
        f"generate, {output!r} in model outputs; fastgen knows {' / '.join(KNOWN_CACHE_NAMES)}); fastgen was "
        f"tested up to transformers {NEWEST_TESTED}: pin transformers=={NEWEST_TESTED} or upgrade fastgen"
    )


def unknown_structure(what: str) -> str:
    """A fallback reason for a structure fastgen does not know, naming the versions and what to do."""
    return (
        f"{what}: transformers {_installed_version()} is not what fastgen knows (tested up to "
        f"{NEWEST_TESTED}): pin transformers=={NEWEST_TESTED} or upgrade fastgen"
    )


def problem() -> str | None:
    """Why the installed Transformers' structure rules fastgen's cache-touching patches out, or None."""
    return _resolved()[1]


#: The cache's name in ``generate``'s kwargs, ``model_kwargs``, ``forward`` kwargs and outputs
#: (``cache`` from 5.24, ``past_key_values`` before). Patches that use it are declared with
#: ``requires`` naming :func:`problem`, so none runs on a release where it could not be resolved.
CACHE: str = _resolved()[0] or KNOWN_CACHE_NAMES[-1]
