"""n-gram blocking (feature "ngram") in HF's logits processors and fairseq's ``NGramRepeatBlock``.

HF: patched generation must equal upstream (``fastgen.unpatched()``) token for token, with the op
actually doing the work (a spy counts the op's calls and bans, and that nothing fell back).
fairseq: upstream's CPU blocker bans nothing, so the patched output is compared with upstream's
``SequenceGenerator`` driven by a blocker that hands fairseq's own ``_no_repeat_ngram`` only the valid
tokens, i.e. the intended semantics (those of fairseq's CUDA kernel).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor

import fastgen
from fastgen.optimizer.transformers import ngram as hf_ngram
from tests import harness
from tests.conftest import HAS_FAIRSEQ

# Tests of the Transformers patches' mechanism skip where they are not declared for the version.
needs_hf_ngram = harness.requires_feature("ngram")

NEW_TOKENS = 12


class Spy:
    """Counts op calls, entries newly banned, and fallbacks to upstream."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.banned = 0
        self.fallbacks: list[str] = []

    def wrap(self, name: str, op: Any) -> Any:
        def spied(*args: Any, **kwargs: Any) -> torch.Tensor:
            scores = args[2] if name == "ban_encoder_ngrams" else args[1]
            before = int(torch.isinf(scores).sum())
            out = op(*args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.banned += int(torch.isinf(out).sum()) - before
            return out

        return spied


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    spy = Spy()
    modules = [hf_ngram]
    if HAS_FAIRSEQ:
        from fastgen.optimizer.fairseq import ngram as fairseq_ngram

        modules.append(fairseq_ngram)
    for module in modules:
        for name in ("ban_repeated_ngrams", "ban_encoder_ngrams"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spy.wrap(name, getattr(module, name)))
        monkeypatch.setattr(module, "fallback", lambda feature, reason: spy.fallbacks.append(reason))
    from fastgen.optimizer.transformers import beam_search  # fastgen's beam loop calls the ops itself

    for name in ("ban_repeated_ngrams", "ban_encoder_ngrams"):
        monkeypatch.setattr(beam_search, name, spy.wrap(name, getattr(beam_search, name)))
    yield spy


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """One tiny model per family, built once for the module."""
    return {family: harness.tiny_hf_model(family) for family in harness.HF_FAMILIES}


# ------------------------------------------------------------------------------------------ HF

MODES: dict[str, dict[str, Any]] = {
    "beam-n3": dict(num_beams=4, no_repeat_ngram_size=3),
    "beam-n2-return2": dict(num_beams=4, no_repeat_ngram_size=2, num_return_sequences=2),
    "greedy-n2": dict(no_repeat_ngram_size=2),
    "greedy-n3": dict(no_repeat_ngram_size=3),
    "sample-n2": dict(do_sample=True, no_repeat_ngram_size=2, num_return_sequences=2),
    "beam_sample-n3": dict(num_beams=3, do_sample=True, no_repeat_ngram_size=3),
}


@needs_hf_ngram
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(harness.HF_FAMILIES))
def test_no_repeat_ngram_matches_upstream(models: dict[str, Any], spy: Spy, family: str, mode: str) -> None:
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=3)  # padded rows, on the side the family expects
    harness.assert_same_generation(model, inputs, features=["ngram"], max_new_tokens=NEW_TOKENS, **MODES[mode])
    assert spy.calls.get("ban_repeated_ngrams", 0) > 0 and not spy.fallbacks, (spy.calls, spy.fallbacks)


@needs_hf_ngram
@pytest.mark.parametrize("family", ["t5", "gpt2", "qwen2"])
def test_blocking_changes_the_output(models: dict[str, Any], spy: Spy, family: str) -> None:
    """The equality tests above are not vacuous: on these tiny models the blocker changes the output."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=3)
    prompt = 0 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
    with fastgen.patched(["ngram"]):
        blocked = model.generate(**inputs, num_beams=4, no_repeat_ngram_size=2, max_new_tokens=NEW_TOKENS)
        free = model.generate(**inputs, num_beams=4, max_new_tokens=NEW_TOKENS)
    assert spy.banned > 0
    assert any(harness.has_repeated_ngram(_unpadded(row), 2) for row in free[:, prompt:].tolist())
    assert not any(harness.has_repeated_ngram(_unpadded(row), 2) for row in blocked[:, prompt:].tolist())


def _unpadded(row: list[int]) -> list[int]:
    """A generated row without the padding that follows EOS."""
    while row and row[-1] == harness.PAD:
        row = row[:-1]
    return row


N1_MODES: dict[str, dict[str, Any]] = {
    "beam": dict(num_beams=4, no_repeat_ngram_size=1),
    "greedy": dict(no_repeat_ngram_size=1),
    "sample": dict(do_sample=True, no_repeat_ngram_size=1, num_return_sequences=2),
}


@needs_hf_ngram
@pytest.mark.parametrize("mode", list(N1_MODES))
@pytest.mark.parametrize("family", ["bart", "t5", "gpt2"])
def test_no_repeat_ngram_1_matches_upstream(models: dict[str, Any], spy: Spy, family: str, mode: str) -> None:
    """HF's n = 1 bans every id in ``input_ids``: the prompt (decoder-only) and the decoder start token
    (encoder-decoder; BART's is EOS, so it can never finish early). fastgen keeps exactly that."""
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=2)
    _, candidate = harness.assert_same_generation(
        model, inputs, features=["ngram"], max_new_tokens=NEW_TOKENS, **N1_MODES[mode]
    )
    assert spy.calls.get("ban_repeated_ngrams", 0) > 0 and spy.banned > 0 and not spy.fallbacks
    # Generated tokens are all distinct (bar the decoder start token and a forced final EOS).
    prompt = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
    for row in candidate.sequences[:, prompt:].tolist():
        row = _unpadded(row)
        row = row[:-1] if row and row[-1] == harness.EOS else row
        assert len(set(row)) == len(row), row


ENCODER_MODES: dict[str, dict[str, Any]] = {
    "beam-n2": dict(num_beams=4, encoder_no_repeat_ngram_size=2),
    "greedy-n1": dict(encoder_no_repeat_ngram_size=1),
    "beam-n3-with-decoder-n2": dict(num_beams=3, encoder_no_repeat_ngram_size=3, no_repeat_ngram_size=2),
    "sample-n2": dict(do_sample=True, encoder_no_repeat_ngram_size=2, num_return_sequences=2),
}


@needs_hf_ngram
@pytest.mark.parametrize("mode", list(ENCODER_MODES))
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_no_repeat_ngram_matches_upstream(models: dict[str, Any], spy: Spy, family: str, mode: str) -> None:
    model = models[family]
    # Short prompts over few ids, so hypotheses do meet the prompt's n-grams.
    inputs = harness.tiny_inputs(model, batch=2, length=16)
    inputs["input_ids"] = torch.where(inputs["attention_mask"] == 1, inputs["input_ids"] % 12 + 3, harness.PAD)
    harness.assert_same_generation(model, inputs, features=["ngram"], max_new_tokens=NEW_TOKENS, **ENCODER_MODES[mode])
    assert spy.calls.get("ban_encoder_ngrams", 0) > 0 and not spy.fallbacks, (spy.calls, spy.fallbacks)
    assert spy.banned > 0


@needs_hf_ngram
@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_all_features_together(models: dict[str, Any], spy: Spy, family: str) -> None:
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=3)
    extra = dict(encoder_no_repeat_ngram_size=2) if model.config.is_encoder_decoder else {}
    harness.assert_same_generation(
        model, inputs, features=None, max_new_tokens=NEW_TOKENS, num_beams=4, no_repeat_ngram_size=3, **extra
    )
    assert spy.calls.get("ban_repeated_ngrams", 0) > 0 and not spy.fallbacks
    assert not extra or spy.calls.get("ban_encoder_ngrams", 0) > 0


# ---------------------------------------------------------------------- in place or a new tensor


@pytest.mark.parametrize(
    "mode",
    [
        dict(do_sample=True),
        dict(),  # greedy: _sample too
        dict(num_beams=4),
        dict(num_beams=3, do_sample=True),
    ],
    ids=["sample", "greedy", "beam", "beam_sample"],
)
@needs_hf_ngram
@pytest.mark.parametrize("family", ["bart", "llama"])
def test_raw_logits_are_not_written_into(models: dict[str, Any], spy: Spy, family: str, mode: dict) -> None:
    """``_sample`` hands the processors the very tensor it stores as ``logits``: bans must not leak there.

    The no-repeat processor is the first in the list here, so it receives ``next_token_logits`` itself.
    """
    model = models[family]
    inputs = harness.tiny_inputs(model, batch=2)
    kwargs = dict(mode, no_repeat_ngram_size=2, output_logits=True, output_scores=True)
    if model.config.is_encoder_decoder:
        kwargs["encoder_no_repeat_ngram_size"] = 2
    reference, candidate = harness.assert_same_generation(
        model, inputs, features=["ngram"], max_new_tokens=NEW_TOKENS, **kwargs
    )
    assert spy.banned > 0
    assert len(reference.logits) == len(candidate.logits) == len(candidate.scores)
    for step, (ref, cand) in enumerate(zip(reference.logits, candidate.logits, strict=True)):
        assert torch.equal(ref, cand), f"raw logits differ at step {step}"
        assert torch.isfinite(cand).all(), f"bans leaked into the raw logits at step {step}"
    assert any(torch.isinf(s).any() for s in candidate.scores)


@needs_hf_ngram
def test_decoder_processor_returns_input_before_n_then_a_new_tensor() -> None:
    processor = NoRepeatNGramLogitsProcessor(3)
    scores = torch.randn(2, 10)
    kept = scores.clone()
    with fastgen.patched(["ngram"]):
        assert processor(torch.tensor([[4, 5], [6, 7]]), scores) is scores  # cur_len < n: the input itself
        out = processor(torch.tensor([[4, 5, 9, 4, 5], [6, 7, 6, 7, 6]]), scores)
    assert out is not scores and torch.equal(scores, kept)  # the caller's tensor is untouched
    with fastgen.unpatched():
        expected = processor(torch.tensor([[4, 5, 9, 4, 5], [6, 7, 6, 7, 6]]), scores)
    assert torch.equal(out, expected) and torch.isinf(out[0, 9]) and torch.isinf(out[1, 7])


@needs_hf_ngram
def test_encoder_processor_returns_a_new_tensor() -> None:
    with fastgen.patched(["ngram"]):
        processor = EncoderNoRepeatNGramLogitsProcessor(2, torch.tensor([[3, 4, 5, 3, 6]]))
        scores = torch.randn(2, 10)
        kept = scores.clone()
        out = processor(torch.tensor([[0, 3], [0, 5]]), scores)
    assert out is not scores and torch.equal(scores, kept)
    with fastgen.unpatched():
        expected = processor(torch.tensor([[0, 3], [0, 5]]), scores)
    assert torch.equal(out, expected) and torch.isinf(out[0, [4, 6]]).all() and torch.isinf(out[1, 3])


# ------------------------------------------------------------------------ calls handed to upstream


def _both(processor: Any, input_ids: torch.Tensor, scores: torch.Tensor) -> tuple[Any, Any]:
    """(upstream, fastgen) result of one call, an exception standing for its type and message."""
    results = []
    for scope in (fastgen.unpatched(), fastgen.patched(["ngram"])):
        with scope:
            try:
                results.append(processor(input_ids, scores))
            except Exception as exc:  # upstream raising is part of its contract
                results.append((type(exc), str(exc)))
    return results[0], results[1]


def _assert_equal_results(upstream: Any, patched: Any) -> None:
    if isinstance(upstream, torch.Tensor):
        assert isinstance(patched, torch.Tensor) and torch.equal(upstream, patched)
    else:
        assert upstream == patched


@needs_hf_ngram
def test_decoder_ids_outside_vocab(spy: Spy) -> None:
    """Ids >= V are skipped by upstream and by the op alike (no fallback); negative ids go to upstream."""
    scores = torch.randn(2, 8)
    large = torch.tensor([[3, 9, 3, 9, 3], [1, 2, 1, 2, 1]])  # 9 >= V would complete "3 9"
    _assert_equal_results(*_both(NoRepeatNGramLogitsProcessor(2), large, scores))
    assert spy.calls and not spy.fallbacks
    negative = torch.tensor([[3, -1, 3, 4, 3], [1, 2, 1, 2, 1]])
    upstream, patched = _both(NoRepeatNGramLogitsProcessor(2), negative, scores)
    assert isinstance(upstream, tuple) and upstream[0] is RuntimeError  # upstream raises: scatter index -1
    _assert_equal_results(upstream, patched)
    assert any("negative" in reason for reason in spy.fallbacks)


@pytest.mark.parametrize(
    "prompt, hypotheses",
    [
        (torch.tensor([[3, 12, 5]]), torch.tensor([[0, 3]])),  # prompt id >= V: upstream raises IndexError
        (torch.tensor([[3, -2, 5]]), torch.tensor([[0, 3]])),  # negative prompt id: upstream wraps it
        (torch.tensor([[3, 4, 5], [3, 5, 6]]), torch.tensor([[0, 3], [0, 3], [0, 3]])),  # 3 rows for 2 prompts
    ],
    ids=["prompt-id-ge-vocab", "negative-prompt-id", "rows-not-a-multiple"],
)
@needs_hf_ngram
def test_encoder_unsupported_calls_go_to_upstream(spy: Spy, prompt: torch.Tensor, hypotheses: torch.Tensor) -> None:
    with fastgen.patched(["ngram"]):
        processor = EncoderNoRepeatNGramLogitsProcessor(2, prompt)
    _assert_equal_results(*_both(processor, hypotheses, torch.randn(hypotheses.shape[0], 10)))
    assert spy.fallbacks and not spy.calls


@needs_hf_ngram
def test_encoder_processor_built_while_inactive_goes_to_upstream(spy: Spy) -> None:
    with fastgen.unpatched():
        processor = EncoderNoRepeatNGramLogitsProcessor(2, torch.tensor([[3, 4, 5, 3, 6]]))
    _assert_equal_results(*_both(processor, torch.tensor([[0, 3]]), torch.randn(1, 10)))
    assert spy.fallbacks and not spy.calls


@needs_hf_ngram
def test_status_lists_the_ngram_patches() -> None:
    import transformers.generation.logits_process  # noqa: F401  (the patches apply on import)

    with fastgen.patched(["ngram"]):
        rows = [row for row in fastgen.status() if row.feature == "ngram" and row.target.startswith("transformers")]
    assert len(rows) == 3 and all(row.state == "applied" for row in rows), rows


# ------------------------------------------------------------------------------------- fairseq

fairseq_only = pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
FAIRSEQ_LEN = 24


def _valid_tokens_blocker(n: int) -> Any:
    """Upstream's Python blocker, handed only the ``step + 1`` valid tokens: the intended semantics."""
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    class ValidTokensBlocker(NGramRepeatBlock):
        def forward(self, tokens: torch.Tensor, lprobs: torch.Tensor, bsz: int, beam_size: int, step: int) -> Any:
            return self._no_repeat_ngram(tokens[:, : step + 1], lprobs, bsz, beam_size, step)

    return ValidTokensBlocker(n, use_extension=False)


def _generate_with_reference_blocker(model: Any, dictionary: Any, sample: dict, **kwargs: Any) -> list:
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], dictionary, **kwargs)
    generator.repeat_ngram_blocker = _valid_tokens_blocker(kwargs["no_repeat_ngram_size"])
    with fastgen.unpatched(), torch.no_grad():
        return generator.generate([model], sample)


@fairseq_only
@pytest.mark.parametrize("features", [["ngram"], None], ids=["ngram", "all-features"])
@pytest.mark.parametrize("n", [2, 3])
def test_fairseq_cpu_blocks_ngrams_as_intended(fairseq_transformer: Any, spy: Spy, n: int, features: Any) -> None:
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    kwargs = dict(beam_size=4, no_repeat_ngram_size=n, max_len_b=FAIRSEQ_LEN)
    reference = _generate_with_reference_blocker(model, dictionary, sample, **kwargs)
    with fastgen.patched(features):
        candidate = harness.fairseq_generate(model, dictionary, sample, **kwargs)
    assert spy.calls.get("ban_repeated_ngrams", 0) > 0 and spy.banned > 0 and not spy.fallbacks
    for i, (ref_hypos, cand_hypos) in enumerate(zip(reference, candidate, strict=True)):
        assert len(ref_hypos) == len(cand_hypos) == 4
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["tokens"], cand["tokens"]), (i, ref["tokens"].tolist(), cand["tokens"].tolist())
            harness.assert_close_scores(
                ref["positional_scores"], cand["positional_scores"], f"sentence {i}", 1e-5, 1e-5
            )
            assert not harness.has_repeated_ngram(cand["tokens"].tolist(), n), cand["tokens"].tolist()


@fairseq_only
@pytest.mark.parametrize("n", [2, 3])
def test_fairseq_upstream_cpu_blocker_bans_nothing(fairseq_transformer: Any, n: int) -> None:
    """The bug is real: unpatched CPU output repeats n-grams and equals generation without blocking."""
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    with fastgen.unpatched():
        blocked = harness.fairseq_generate(model, dictionary, sample, beam_size=4, no_repeat_ngram_size=n, max_len_b=24)
        free = harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=24)
    assert any(harness.has_repeated_ngram(h["tokens"].tolist(), n) for hypos in blocked for h in hypos)
    for blocked_hypos, free_hypos in zip(blocked, free, strict=True):
        assert [h["tokens"].tolist() for h in blocked_hypos] == [h["tokens"].tolist() for h in free_hypos]


_HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param(
        "triton",
        id="triton",
        marks=pytest.mark.skipif(
            not _HAS_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
            reason="Triton missing, or no GPU and no TRITON_INTERPRET=1",
        ),
    ),
    pytest.param(
        "cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


@fairseq_only
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fairseq_forward_bans_in_place_on_valid_tokens(n: int, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct calls on a padded buffer: in place like upstream, equal to the CUDA kernel's semantics
    (but for n = 1, the start token), on every backend of the op."""
    monkeypatch.setenv("FASTGEN_BACKEND", backend)
    device = "cuda" if backend == "cuda" else "cpu"
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    generator = torch.Generator().manual_seed(n)
    bsz, beam, step, vocab = 2, 3, 9, 7
    tokens = torch.full((bsz * beam, 14), 1)  # pad past the valid step + 1 tokens, as fairseq's buffer
    tokens[:, 0] = 2  # the start token (fairseq: EOS), never generated again by a live hypothesis
    tokens[:, 1 : step + 1] = torch.randint(3, 6, (bsz * beam, step), generator=generator)  # few ids: repeats
    lprobs = torch.randn(bsz * beam, vocab, generator=generator)
    expected = lprobs.clone()
    # fairseq's CUDA kernel: every window of the valid tokens whose first n-1 equal the last n-1 bans its last;
    # except that for n == 1 the start token (window 0) is not a 1-gram of the hypothesis.
    for row in range(bsz * beam):
        valid = tokens[row, : step + 1].tolist()
        for i in range(1 if n == 1 else 0, step + 2 - n):
            if valid[i : i + n - 1] == valid[step + 2 - n :]:
                expected[row, valid[i + n - 1]] = float("-inf")
    blocker = NGramRepeatBlock(n, use_extension=False)
    tokens, lprobs = tokens.to(device), lprobs.to(device)
    with fastgen.patched(["ngram"]):
        out = blocker(tokens, lprobs, bsz, beam, step)
    assert out is lprobs and torch.equal(lprobs.cpu(), expected)
    assert torch.isinf(expected).any() and not torch.isinf(expected[:, 2]).any()
    with fastgen.patched(["ngram"]), pytest.raises(AssertionError):
        blocker(tokens, lprobs, bsz + 1, beam, step)  # a wrong row count still fails as upstream does


# ------------------------------------------------------------------- fairseq, no_repeat_ngram_size=1


def _one_gram_blocker(start_is_a_token: bool) -> Any:
    """A plain-Python blocker for n = 1: bans every token of ``tokens[:, first : step + 1]``.

    ``start_is_a_token=False`` is fastgen's semantics (the start token at position 0 is not a generated
    token); ``True`` is what fairseq's CUDA kernel does for n = 1 (read from
    ``fairseq/clib/cuda/ngram_repeat_block_cuda_kernel.cu`` at v0.12.3: ``step + 1`` threads, each
    banning ``tokens[row, col]``, column 0 included).
    """
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    first = 0 if start_is_a_token else 1

    class OneGramBlocker(NGramRepeatBlock):
        def forward(self, tokens: torch.Tensor, lprobs: torch.Tensor, bsz: int, beam_size: int, step: int) -> Any:
            for row in range(tokens.shape[0]):
                lprobs[row, tokens[row, first : step + 1].unique()] = float("-inf")
            return lprobs

    return OneGramBlocker(1, use_extension=False)


def _generate_with(blocker: Any, model: Any, dictionary: Any, sample: dict, **kwargs: Any) -> list:
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], dictionary, no_repeat_ngram_size=1, **kwargs)
    generator.repeat_ngram_blocker = blocker
    torch.manual_seed(0)
    with fastgen.unpatched(), torch.no_grad():
        return generator.generate([model], sample)


FAIRSEQ_N1_MODES = {
    "beam": dict(beam_size=4),
    "greedy": dict(beam_size=1),
    "sampling": dict(beam_size=3, sampling=True, sampling_topk=8),
}


@fairseq_only
@pytest.mark.parametrize("mode", list(FAIRSEQ_N1_MODES))
def test_fairseq_no_repeat_ngram_1_finishes(fairseq_transformer: Any, spy: Spy, mode: str) -> None:
    """n = 1 used to ban the start token (EOS) at every step, so fairseq's ``assert step < max_len`` fired."""
    from fairseq import search

    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    kwargs = dict(FAIRSEQ_N1_MODES[mode], max_len_b=FAIRSEQ_LEN)
    if kwargs.pop("sampling", False):
        kwargs["search_strategy"] = search.Sampling(dictionary, sampling_topk=kwargs.pop("sampling_topk"))
    reference = _generate_with(_one_gram_blocker(start_is_a_token=False), model, dictionary, sample, **kwargs)
    with fastgen.patched(["ngram"]):
        torch.manual_seed(0)
        candidate = harness.fairseq_generate(model, dictionary, sample, no_repeat_ngram_size=1, **kwargs)
    assert spy.calls.get("ban_repeated_ngrams", 0) > 0 and spy.banned > 0 and not spy.fallbacks
    for ref_hypos, cand_hypos in zip(reference, candidate, strict=True):
        assert len(ref_hypos) == len(cand_hypos) == kwargs["beam_size"]
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["tokens"], cand["tokens"]), (ref["tokens"].tolist(), cand["tokens"].tolist())
            harness.assert_close_scores(ref["positional_scores"], cand["positional_scores"], "n=1", 1e-5, 1e-5)
            tokens = cand["tokens"].tolist()
            assert tokens[-1] == dictionary.eos() and len(set(tokens)) == len(tokens), tokens


@fairseq_only
def test_fairseq_cuda_kernel_semantics_for_n1_cannot_finish(fairseq_transformer: Any) -> None:
    """What fairseq's own CUDA kernel does for n = 1 (emulated: no GPU here): it bans the start token
    EOS too, nothing finishes, and SequenceGenerator fails its ``step < max_len`` assertion."""
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=2, length=8)
    with pytest.raises(AssertionError, match=f"{FAIRSEQ_LEN} < {FAIRSEQ_LEN}"):
        _generate_with(_one_gram_blocker(start_is_a_token=True), model, dictionary, sample, beam_size=2,
                       max_len_a=0, max_len_b=FAIRSEQ_LEN)  # fmt: skip
