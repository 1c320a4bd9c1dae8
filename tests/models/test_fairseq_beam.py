"""fairseq SequenceGenerator with fastgen's beam loop ("beam") against upstream's loop."""

import logging
import math

import pytest
import torch

import fastgen
from fastgen.optimizer import registry
from tests import harness
from tests.conftest import HAS_FAIRSEQ

pytestmark = pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")

MAX_LEN = 14


@pytest.fixture(scope="module")
def model_and_dictionary():
    """The tiny transformer with an EOS gain, so that sentences finish at different steps."""
    model, dictionary = harness.tiny_fairseq_transformer()
    with torch.no_grad():  # EOS about as likely as token 7, which this seed favours for some inputs
        model.decoder.output_projection.weight[dictionary.eos()] = model.decoder.output_projection.weight[7] * 1.02
    return model, dictionary


@pytest.fixture
def sample(model_and_dictionary):
    return harness.tiny_fairseq_sample(model_and_dictionary[1], batch=4, length=12)  # left-padded, 4 lengths


def _generate(model, dictionary, sample, call_kwargs=None, use_forward=False, **generator_kwargs):
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], dictionary, **{"max_len_b": MAX_LEN, **generator_kwargs})
    with torch.no_grad():
        if use_forward:
            return generator.forward(sample, **(call_kwargs or {}))
        return generator.generate([model], sample, **(call_kwargs or {}))


def _assert_same(reference, candidate):
    assert len(reference) == len(candidate)
    for i, (ref_hypos, cand_hypos) in enumerate(zip(reference, candidate, strict=True)):
        assert len(ref_hypos) == len(cand_hypos), f"sentence {i}"
        for j, (ref, cand) in enumerate(zip(ref_hypos, cand_hypos, strict=True)):
            where = f"sentence {i} hypothesis {j}"
            assert torch.equal(ref["tokens"], cand["tokens"]), f"{where}: {ref['tokens']} vs {cand['tokens']}"
            assert math.isclose(float(ref["score"]), float(cand["score"]), rel_tol=1e-5, abs_tol=1e-5), where
            harness.assert_close_scores(ref["positional_scores"], cand["positional_scores"], where, 1e-5, 1e-5)
            assert torch.equal(ref["alignment"], cand["alignment"]), where
            if ref["attention"] is not None:
                torch.testing.assert_close(ref["attention"], cand["attention"], atol=1e-6, rtol=1e-6)


def _compare(model, dictionary, sample, features, reference_features=None, **kwargs):
    """Upstream's loop (with ``reference_features``, or none) vs ``features`` + beam; returns both.

    Asserts that fastgen's loop ran and never fell back."""
    reference_scope = fastgen.unpatched() if reference_features is None else fastgen.patched(reference_features)
    with reference_scope:
        reference = _generate(model, dictionary, sample, **kwargs)
    with fastgen.patched([*features, "beam"]), fastgen.report() as report:
        candidate = _generate(model, dictionary, sample, **kwargs)
    assert report.fast_path("beam"), str(report)
    _assert_same(reference, candidate)
    return reference, candidate


def _lengths(hypos):
    return [len(h[0]["tokens"]) for h in hypos]


@pytest.mark.parametrize("features", [[], ["dedup"]], ids=["plain", "dedup"])
@pytest.mark.parametrize("lenpen", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("beam", [1, 4, 5])
def test_beam_sizes_and_length_penalties(model_and_dictionary, sample, features, lenpen, beam):
    model, dictionary = model_and_dictionary
    _, hypos = _compare(model, dictionary, sample, features, beam_size=beam, len_penalty=lenpen)
    assert len({tuple(h[0]["tokens"].tolist()) for h in hypos}) > 1, "outputs ignore the input"


@pytest.mark.parametrize("features", [[], ["dedup"]], ids=["plain", "dedup"])
def test_sentences_finish_at_different_steps_and_leave_the_batch(model_and_dictionary, sample, features):
    model, dictionary = model_and_dictionary
    _, hypos = _compare(model, dictionary, sample, features, beam_size=4)
    lengths = _lengths(hypos)
    assert min(lengths) < max(lengths) == MAX_LEN + 1, lengths  # some stop early, one runs to max_len
    ends = {len(h["tokens"]) for hypos_of_sentence in hypos for h in hypos_of_sentence}
    assert len(ends) > 2, ends  # hypotheses finish at several steps


def test_dedup_keeps_one_encoder_out_per_input_in_the_loop(model_and_dictionary, sample, monkeypatch):
    """With ``dedup`` the loop never expands ``encoder_out`` to B·M rows; it only drops finished inputs."""
    from fairseq.models.transformer import TransformerEncoderBase

    rows: list[int] = []
    original = TransformerEncoderBase.reorder_encoder_out

    def spy(self, encoder_out, new_order):
        rows.append(new_order.numel())
        return original(self, encoder_out, new_order)

    monkeypatch.setattr(TransformerEncoderBase, "reorder_encoder_out", spy)
    model, dictionary = model_and_dictionary
    with fastgen.patched(["dedup", "beam"]), fastgen.report() as report:
        hypos = _generate(model, dictionary, sample, beam_size=4)
    assert report.fast_path("beam"), str(report)
    assert min(_lengths(hypos)) < max(_lengths(hypos))
    assert rows and all(n < 4 for n in rows), rows  # 4 inputs: only shrinking reorders, never 16 rows


@pytest.mark.parametrize("features", [[], ["dedup"]], ids=["plain", "dedup"])
def test_min_len(model_and_dictionary, sample, features):
    model, dictionary = model_and_dictionary
    _, hypos = _compare(model, dictionary, sample, features, beam_size=4, min_len=9)
    assert min(len(h["tokens"]) for hypos_of_sentence in hypos for h in hypos_of_sentence) >= 10


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_with_the_ngram_feature(model_and_dictionary, sample, n):
    """The oracle is upstream's loop with the ``ngram`` feature (upstream's CPU blocker bans nothing)."""
    model, dictionary = model_and_dictionary
    _, hypos = _compare(
        model, dictionary, sample, ["dedup", "ngram"], reference_features=["dedup", "ngram"],
        beam_size=4, no_repeat_ngram_size=n,
    )  # fmt: skip
    for hypos_of_sentence in hypos:
        for h in hypos_of_sentence:
            assert not harness.has_repeated_ngram(h["tokens"][:-1].tolist(), n)


@pytest.mark.parametrize("use_forward", [False, True], ids=["generate", "forward"])
@pytest.mark.parametrize("features", [[], ["dedup"]], ids=["plain", "dedup"])
def test_prefix_tokens(model_and_dictionary, sample, features, use_forward):
    model, dictionary = model_and_dictionary
    pad = dictionary.pad()  # pad: no constraint, so sentence 2 leaves the batch while 3's prefix is forced
    prefix = torch.tensor([[5, 9, 10, 11, 12, 13], [pad] * 6, [7] + [pad] * 5, [8, 9, 10, 11, 12, 13]])
    _, hypos = _compare(
        model, dictionary, sample, features, beam_size=4, call_kwargs={"prefix_tokens": prefix}, use_forward=use_forward
    )
    for row, hypos_of_sentence in zip(prefix.tolist(), hypos, strict=True):
        forced = [t for t in row if t != pad]
        assert all(h["tokens"][: len(forced)].tolist() == forced for h in hypos_of_sentence)
    assert min(_lengths(hypos)) < prefix.shape[1], _lengths(hypos)  # a sentence left while prefixes were forced


@pytest.mark.parametrize(
    "options",
    [
        dict(unk_penalty=-4.0, temperature=0.7),  # a bonus: unk appears
        dict(normalize_scores=False, tokens_to_suppress=["w3", "w4"]),
        dict(match_source_len=True),
        dict(max_len_a=0.5, max_len_b=3),
    ],
    ids=["unk-temperature", "unnormalized-suppress", "match-source-len", "max-len-a"],
)
def test_generator_options(model_and_dictionary, sample, options):
    model, dictionary = model_and_dictionary
    _, hypos = _compare(model, dictionary, sample, ["dedup"], beam_size=4, **options)
    produced = {t for hypos_of_sentence in hypos for h in hypos_of_sentence for t in h["tokens"].tolist()}
    assert (dictionary.unk() in produced) == (options.get("unk_penalty", 0) < 0)


def test_bos_token(model_and_dictionary, sample):
    model, dictionary = model_and_dictionary
    _compare(model, dictionary, sample, ["dedup"], beam_size=3, call_kwargs={"bos_token": 5})


def test_nan_and_inf_log_probs_become_what_upstream_makes_of_them():
    from fastgen.optimizer.fairseq.beam_search import _edit_log_probs

    class _Gen:
        pad, unk, eos, unk_penalty = 1, 3, 2, 0.25

    lprobs = torch.randn(6, 11)
    lprobs[0, 4] = lprobs[3, 3] = float("nan")
    lprobs[1, 5], lprobs[2, 6], lprobs[4, 0] = float("inf"), float("-inf"), -0.0
    for step, max_len in ((0, 5), (5, 5)):
        expected, actual = lprobs.clone(), lprobs.clone()
        expected[expected != expected] = torch.tensor(-math.inf)  # upstream's lines, in its order
        expected[:, 1] = -math.inf
        expected[:, 3] -= 0.25
        if step >= max_len:
            expected[:, :2] = -math.inf
            expected[:, 3:] = -math.inf
        _edit_log_probs(_Gen(), actual, step, max_len)
        assert torch.equal(actual.isnan(), torch.zeros_like(actual, dtype=torch.bool))
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        assert torch.equal(actual.signbit(), expected.signbit())


# ------------------------------------------------------------------------------------- fallbacks


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Every fallback warns again (warnings are once per process), captured from the fastgen logger."""
    monkeypatch.setattr(registry._state, "warned", set())
    caplog.set_level(logging.WARNING, logger="fastgen")
    return caplog


def _assert_falls_back(model, dictionary, sample, caplog, reason, call_kwargs=None, **generator_kwargs):
    with fastgen.unpatched():
        torch.manual_seed(0)
        reference = _generate(model, dictionary, sample, call_kwargs=call_kwargs, **generator_kwargs)
    with fastgen.patched(["dedup", "beam"]), fastgen.report() as report:
        torch.manual_seed(0)
        candidate = _generate(model, dictionary, sample, call_kwargs=call_kwargs, **generator_kwargs)
    _assert_same(reference, candidate)
    assert "beam" not in report.ran and [r for f, r in report.fell_back if f == "beam"], str(report)
    # (the HF half of the feature may also warn once that its Transformers version is outside its range)
    warnings = [r.getMessage() for r in caplog.records if "[beam] falling back" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0], warnings


def test_diverse_beam_search_runs_upstream(model_and_dictionary, sample, fresh_warnings):
    from fairseq.search import DiverseBeamSearch

    model, dictionary = model_and_dictionary
    search = DiverseBeamSearch(dictionary, num_groups=2, diversity_strength=0.5)
    _assert_falls_back(
        model, dictionary, sample, fresh_warnings, "DiverseBeamSearch", beam_size=4, search_strategy=search
    )


def test_constraints_run_upstream(model_and_dictionary, sample, fresh_warnings):
    from fairseq.search import LexicallyConstrainedBeamSearch
    from fairseq.token_generation_constraints import pack_constraints

    model, dictionary = model_and_dictionary
    constraints = pack_constraints([[torch.tensor([9, 10])], [], [torch.tensor([5])], []])
    search = LexicallyConstrainedBeamSearch(dictionary, "ordered")
    _assert_falls_back(
        model, dictionary, sample, fresh_warnings, "LexicallyConstrainedBeamSearch",
        call_kwargs={"constraints": constraints}, beam_size=4, search_strategy=search,
    )  # fmt: skip


def test_lm_fusion_runs_upstream(model_and_dictionary, sample, fresh_warnings):
    model, dictionary = model_and_dictionary
    lm, _ = harness.tiny_fairseq_transformer(seed=3)

    class _DecoderAsLM(torch.nn.Module):
        """A language model as SequenceGenerator calls one: tokens in, log-probs via the decoder."""

        def __init__(self, decoder):
            super().__init__()
            self.decoder = decoder

        def forward(self, tokens):
            return self.decoder(tokens)

        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return self.decoder.get_normalized_probs(net_output, log_probs, sample)

    _assert_falls_back(
        model, dictionary, sample, fresh_warnings, "LM fusion",
        beam_size=4, lm_model=_DecoderAsLM(lm.decoder), lm_weight=0.3,
    )  # fmt: skip


def test_sampling_runs_upstream(model_and_dictionary, sample, fresh_warnings):
    from fairseq.search import Sampling

    model, dictionary = model_and_dictionary
    search = Sampling(dictionary, sampling_topk=5)
    _assert_falls_back(model, dictionary, sample, fresh_warnings, "Sampling", beam_size=3, search_strategy=search)


def test_ensemble_runs_upstream(model_and_dictionary, sample, fresh_warnings):
    from fairseq.sequence_generator import SequenceGenerator

    model, dictionary = model_and_dictionary
    other, _ = harness.tiny_fairseq_transformer(seed=5)

    def run(scope):
        with scope, torch.no_grad():
            generator = SequenceGenerator([model, other], dictionary, beam_size=3, max_len_b=MAX_LEN)
            return generator.generate([model, other], sample)

    _assert_same(run(fastgen.unpatched()), run(fastgen.patched(["beam"])))
    warnings = [r.getMessage() for r in fresh_warnings.records if "[beam] falling back" in r.getMessage()]
    assert len(warnings) == 1 and "2 models" in warnings[0], warnings


def test_no_full_vocabulary_compare_index_put_or_add_outside_the_model():
    """Upstream's NaN line (N×V ``ne`` + boolean ``index_put_``) and ``BeamSearch.step``'s out-of-place
    ``lprobs + score`` are gone; everything over the vocabulary after the forward is in place."""
    from torch.profiler import profile

    model, dictionary = harness.tiny_fairseq_transformer(vocab=71)  # a width no other tensor has
    sample = harness.tiny_fairseq_sample(dictionary, batch=3)
    vocab = len(dictionary)
    counts = {}
    for variant, scope in (("upstream", fastgen.unpatched()), ("fastgen", fastgen.patched(["dedup", "beam"]))):
        with scope, profile(record_shapes=True) as prof:
            _generate(model, dictionary, sample, beam_size=4)
        counts[variant] = {
            name: sum(e.name == name and any(s and s[-1] == vocab for s in e.input_shapes) for e in prof.events())
            for name in ("aten::ne", "aten::index_put_", "aten::add")
        }
    assert all(n > 0 for n in counts["upstream"].values()), counts  # the test sees what it looks for
    assert not any(counts["fastgen"].values()), counts
