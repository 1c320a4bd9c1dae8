"""Declarations of the fairseq patches: strings only; fairseq is never imported here."""

from fastgen.optimizer.registry import Patch

FAIRSEQ_VERSIONS = ">=0.12.2,<0.13"
_DEDUP = "fastgen.optimizer.fairseq.dedup"

PATCHES: list[Patch] = [
    Patch(
        "dedup",
        "fairseq.sequence_generator:SequenceGenerator._generate",
        f"{_DEDUP}:make_generate",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "sample", "prefix_tokens", "constraints", "bos_token"),
    ),
    Patch(
        "dedup",
        "fairseq.sequence_generator:EnsembleModel.reorder_encoder_out",
        f"{_DEDUP}:make_reorder_encoder_out",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "encoder_outs", "new_order"),
    ),
]

# ---------------------------------------------------------------------------- ngram
_NGRAM = "fastgen.optimizer.fairseq.ngram"

PATCHES += [
    # Block n-grams on the valid tokens only (step + 1 of them) on every device: upstream's CPU path bans nothing.
    Patch(
        "ngram",
        "fairseq.ngram_repeat_block:NGramRepeatBlock.forward",
        f"{_NGRAM}:make_forward",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "tokens", "lprobs", "bsz", "beam_size", "step"),
    ),
]

# ---------------------------------------------------------------------------- beam
_BEAM = "fastgen.optimizer.fairseq.beam_search"

PATCHES += [
    # fastgen's beam loop (in-place NaN fix, fused add + top-k); the dedup wrapper composes with it.
    Patch(
        "beam",
        "fairseq.sequence_generator:SequenceGenerator.generate",
        f"{_BEAM}:make_generate",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "models", "sample"),
    ),
    Patch(
        "beam",
        "fairseq.sequence_generator:SequenceGenerator.forward",
        f"{_BEAM}:make_forward",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "sample", "prefix_tokens", "bos_token"),
    ),
]

# ---------------------------------------------------------------------------- gemm
# Every CPU fp32 nn.Linear in its fastest bit-identical GEMM form (fastgen.ops.linear): the vocabulary
# projection through output_layer, the others for the length of SequenceGenerator.generate.
PATCHES += [
    Patch(
        "gemm",
        "fairseq.models.transformer.transformer_decoder:TransformerDecoderBase.output_layer",
        "fastgen.optimizer.fairseq.gemm:make_output_layer",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "features"),
    ),
    Patch(
        "gemm",
        "fairseq.sequence_generator:SequenceGenerator.generate",
        "fastgen.optimizer.fairseq.gemm:make_generate",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "models", "sample"),
    ),
]

# ---------------------------------------------------------------------------- fast_gemm (opt-in)
# Every CPU fp32 nn.Linear of the generator's models on packed weights (oneDNN or MKL): faster, not
# bit-identical (fastgen.optimizer.fairseq.linear_modes). Stacks on beam's generate hook.
PATCHES += [
    Patch(
        "fast_gemm",
        "fairseq.sequence_generator:SequenceGenerator.generate",
        "fastgen.optimizer.fairseq.linear_modes:make_generate",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "models", "sample"),
    ),
]

# ---------------------------------------------------------------------------- int8 (opt-in)
# Every CPU fp32 nn.Linear of the generator's models in int8 (fastgen.ops.int8_linear). Declared after
# fast_gemm so its hook wraps fast_gemm's: with both on, int8 serves the linears.
PATCHES += [
    Patch(
        "int8",
        "fairseq.sequence_generator:SequenceGenerator.generate",
        "fastgen.optimizer.fairseq.linear_modes:make_int8_generate",
        "fairseq",
        FAIRSEQ_VERSIONS,
        expects=("self", "models", "sample"),
    ),
]
