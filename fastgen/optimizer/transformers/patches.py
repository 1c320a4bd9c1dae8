"""Declarations of the Transformers patches: strings only, so reading them imports nothing heavy."""

from fastgen.optimizer.registry import Patch

#: fastgen imports and leaves upstream intact on transformers >=5.15 (CI tests 5.15.1), but its
#: patches are declared for 5.18+: before 5.18 ``_expand_inputs_for_generation`` is a staticmethod
#: (the dedup hook cannot see the model family) and ``NoRepeatNGramLogitsProcessor`` raises on ids
#: >= vocab instead of skipping them, so the replacements would not match those versions exactly.
HF_VERSIONS = ">=5.18,<6"

#: Patches that touch the cache need its name for the installed release (5.24 renamed it): the
#: contract module resolves it and says why not on a release whose structure it does not know.
CONTRACT = "fastgen.optimizer.transformers.contract:problem"

PATCHES: list[Patch] = []

_DEDUP = "fastgen.optimizer.transformers.dedup"

PATCHES += [
    # Keep encoder states and mask at one row per input (encoder-decoder beam search / multi-sample).
    Patch(
        feature="dedup",
        target="transformers.generation.utils:GenerationMixin._expand_inputs_for_generation",
        factory=f"{_DEDUP}:make_expand_inputs",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("self", "expand_size", "is_encoder_decoder", "input_ids"),
    ),
    # Confirm (beam-shared cross-attention cache) or undo (upstream expansion) per decoding mode;
    # decoder-only: install the shared-prompt cache.
    Patch(
        feature="dedup",
        target="transformers.generation.utils:GenerationMixin._prepare_cache_for_generation",
        factory=f"{_DEDUP}:make_prepare_cache",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"),
    ),
    # Decoder-only: prefill the prompt once per input into the shared-prompt cache, repeat the outputs.
    Patch(
        feature="dedup",
        target="transformers.generation.utils:GenerationMixin._prefill",
        factory="fastgen.optimizer.transformers.prompt_dedup:make_prefill",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("input_ids", "generation_config", "model_kwargs", "is_first_iteration"),
    ),
    # Run beam queries grouped against the shared cross-attention K/V with the stock sdpa/eager kernels;
    # attend decoder-only suffix keys over their shared prompt prefix. Runs inside every attention
    # layer's forward: installed without the dispatcher so torch.compile can trace it (traced=True).
    Patch(
        feature="dedup",
        target="transformers.modeling_utils:AttentionInterface.get_interface",
        factory=f"{_DEDUP}:make_get_interface",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("attn_implementation", "default"),
        traced=True,
    ),
    # A cache returned to the caller leaves in upstream's classes and layout.
    Patch(
        feature="dedup",
        target="transformers.generation.utils:GenerationMixin.generate",
        factory="fastgen.optimizer.transformers.returned_cache:make_generate",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("self", "inputs", "generation_config"),
    ),
]

# ---------------------------------------------------------------------------- ngram
# n-gram blocking on fastgen's op (fastgen.optimizer.transformers.ngram); a separate block so that
# other features' declarations above merge cleanly.
_NGRAM = "fastgen.optimizer.transformers.ngram"
_PROCESSORS = "transformers.generation.logits_process"

PATCHES += [
    # Ban only the repeated n-grams' successors (a copy of scores, as upstream) instead of an N×(V+1) mask.
    Patch(
        feature="ngram",
        target=f"{_PROCESSORS}:NoRepeatNGramLogitsProcessor.__call__",
        factory=f"{_NGRAM}:make_no_repeat_call",
        package="transformers",
        versions=HF_VERSIONS,
        expects=("self", "input_ids", "scores"),
    ),
    # Keep a snapshot of the prompt ids: upstream keeps only a dict of its n-grams.
    Patch(
        feature="ngram",
        target=f"{_PROCESSORS}:EncoderNoRepeatNGramLogitsProcessor.__init__",
        factory=f"{_NGRAM}:make_encoder_init",
        package="transformers",
        versions=HF_VERSIONS,
        expects=("self", "encoder_ngram_size", "encoder_input_ids"),
    ),
    # Match all hypotheses against the prompt at once instead of a Python loop with .tolist() per hypothesis.
    Patch(
        feature="ngram",
        target=f"{_PROCESSORS}:EncoderNoRepeatNGramLogitsProcessor.__call__",
        factory=f"{_NGRAM}:make_encoder_call",
        package="transformers",
        versions=HF_VERSIONS,
        expects=("self", "input_ids", "scores"),
    ),
]

# ---------------------------------------------------------------------------- beam
# fastgen's own beam search loop (fastgen.optimizer.transformers.beam_search): the fused beam top-k
# step, in-place bans, finished inputs leaving the batch; on by default.
PATCHES += [
    Patch(
        feature="beam",
        target="transformers.generation.utils:GenerationMixin._beam_search",
        factory="fastgen.optimizer.transformers.beam_search:make_beam_search",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus"),
    ),
]

# ---------------------------------------------------------------------------- lean_step
# Greedy and sampling: upstream's loop, each one-token decode step of a BART-family model through the lean step
# (fastgen.optimizer.transformers.lean_sample); on by default.
PATCHES += [
    Patch(
        feature="lean_step",
        target="transformers.generation.utils:GenerationMixin._sample",
        factory="fastgen.optimizer.transformers.lean_sample:make_sample",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus"),
    ),
]

# ---------------------------------------------------------------------------- speculative
# Batched speculative decoding (BASS-PAD): assisted generation and prompt lookup at batch > 1, each
# row accepting its own number of draft tokens (fastgen.optimizer.transformers.speculative). Upstream
# raises for batch > 1 inside _assisted_decoding; batch 1 and unsupported calls go to upstream.
PATCHES += [
    Patch(
        feature="speculative",
        target="transformers.generation.utils:GenerationMixin._assisted_decoding",
        factory="fastgen.optimizer.transformers.speculative:make_assisted_decoding",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
        expects=("self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "assistant_model"),
    ),
]

# ---------------------------------------------------------------------------- gemm
# The vocabulary projection (output embeddings) on CPU fp32 in its fastest bit-identical GEMM form
# (fastgen.optimizer.transformers.gemm, fastgen.ops.linear). Stacks on dedup's generate hook.
PATCHES += [
    Patch(
        feature="gemm",
        target="transformers.generation.utils:GenerationMixin.generate",
        factory="fastgen.optimizer.transformers.gemm:make_generate",
        package="transformers",
        versions=HF_VERSIONS,
        expects=("self", "inputs", "generation_config"),
    ),
]

# ---------------------------------------------------------------------------- fast_gemm (opt-in)
# Every CPU fp32 nn.Linear on packed weights (oneDNN or MKL): faster, not bit-identical
# (fastgen.optimizer.transformers.linear_modes, fastgen.ops.fast_linear). Off by default (OPT_IN_FEATURES).
PATCHES += [
    Patch(
        feature="fast_gemm",
        target="transformers.generation.utils:GenerationMixin.generate",
        factory="fastgen.optimizer.transformers.linear_modes:make_generate",
        package="transformers",
        versions=HF_VERSIONS,
        expects=("self", "inputs", "generation_config"),
    ),
]

# ---------------------------------------------------------------------------- int8 (opt-in)
# Every CPU fp32 nn.Linear in int8 (weights per channel, activations per row; fastgen.ops.int8_linear).
# Declared after fast_gemm so its hook wraps fast_gemm's: with both on, int8 serves the linears.
PATCHES += [
    Patch(
        feature="int8",
        target="transformers.generation.utils:GenerationMixin.generate",
        factory="fastgen.optimizer.transformers.linear_modes:make_int8_generate",
        package="transformers",
        versions=HF_VERSIONS,
        expects=("self", "inputs", "generation_config"),
    ),
]

# ---------------------------------------------------------------------------- continuous
# Continuous batching (fastgen.generate_many) is fastgen's own loop, not a hook of Transformers; this patch is
# its switch, so it is listed and selected like every other feature. Off (not selected, fastgen disabled,
# inside unpatched(), or a release whose structure the contract does not know), generate_many runs generate
# on each input alone, which is what continuous batching returns for it.
PATCHES += [
    Patch(
        feature="continuous",
        target="fastgen.continuous.settings:switched_on",
        factory="fastgen.continuous.settings:make_switched_on",
        package="transformers",
        versions=HF_VERSIONS,
        requires=CONTRACT,
    ),
]
