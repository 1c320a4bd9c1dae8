"""fairseq SequenceGenerator with the encoder output shared by the beams of each input."""

import pytest
import torch

import fastgen
from tests import harness
from tests.conftest import HAS_FAIRSEQ

pytestmark = pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")


@pytest.fixture
def spy_encoder_reorder(monkeypatch):
    """Records the row count of every encoder-output reorder the generator asks the encoder for."""
    from fairseq.models.transformer import TransformerEncoderBase

    calls: list[int] = []
    original = TransformerEncoderBase.reorder_encoder_out

    def spy(self, encoder_out, new_order):
        calls.append(new_order.numel())
        return original(self, encoder_out, new_order)

    monkeypatch.setattr(TransformerEncoderBase, "reorder_encoder_out", spy)
    return calls


@pytest.mark.parametrize("beam", [2, 4])
def test_beam_search_identical_and_encoder_out_not_expanded(fairseq_transformer, spy_encoder_reorder, beam):
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=4, length=12)
    harness.assert_same_fairseq_generation(model, dictionary, sample, features=["dedup"], beam_size=beam, max_len_b=12)
    calls = {}
    for variant, scope in (("upstream", fastgen.unpatched()), ("fastgen", fastgen.patched(["dedup"]))):
        spy_encoder_reorder.clear()
        with scope:
            harness.fairseq_generate(model, dictionary, sample, beam_size=beam, max_len_b=12)
        calls[variant] = list(spy_encoder_reorder)
    upstream, fastgen_calls = calls["upstream"], calls["fastgen"]
    assert upstream[0] == 4 * beam and len(upstream) > 5  # upstream: expand, then reorder every step
    assert all(n < 4 for n in fastgen_calls) and len(fastgen_calls) < len(upstream)


def test_finished_sentences_leave_the_batch(fairseq_transformer, spy_encoder_reorder):
    """Some sentences finish early and leave the batch: the pruning path must stay exact."""
    model, dictionary = fairseq_transformer
    with torch.no_grad():  # make EOS as likely as token 7, which this seed favours for some inputs
        model.decoder.output_projection.weight[dictionary.eos()] = model.decoder.output_projection.weight[7] * 1.02
    sample = harness.tiny_fairseq_sample(dictionary, batch=4, length=12)
    with fastgen.patched(["dedup"]):
        hypos = harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=16)
    lengths = [len(h[0]["tokens"]) for h in hypos]
    assert min(lengths) < max(lengths) == 17, lengths
    assert spy_encoder_reorder and all(n < 4 for n in spy_encoder_reorder)  # dropped inputs only
    harness.assert_same_fairseq_generation(model, dictionary, sample, features=["dedup"], beam_size=4, max_len_b=16)


def test_cross_attention_cache_holds_one_row_per_input(fairseq_transformer, monkeypatch):
    from fairseq.modules import MultiheadAttention

    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=3)
    rows: set[int] = set()
    original = MultiheadAttention.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        state = kwargs.get("incremental_state")
        if self.encoder_decoder_attention and state is not None:
            rows.add(self._get_input_buffer(state)["prev_key"].size(0))
        return out

    monkeypatch.setattr(MultiheadAttention, "forward", forward)
    with fastgen.patched(["dedup"]):
        harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=6)
    assert rows and max(rows) == 3  # B, not B·M = 12
    rows.clear()
    with fastgen.unpatched():
        harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=6)
    assert max(rows) == 12


def test_sampling_with_beams_and_greedy(fairseq_transformer):
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary)
    harness.assert_same_fairseq_generation(model, dictionary, sample, features=["dedup"], beam_size=1, max_len_b=8)
    from fairseq import search

    sampling = search.Sampling(dictionary, sampling_topk=10)
    harness.assert_same_fairseq_generation(
        model, dictionary, sample, features=["dedup"], beam_size=3, max_len_b=8, search_strategy=sampling
    )


def test_beam_size_restored_after_generation(fairseq_transformer):
    from fastgen.models.fairseq_transformer import cross_attention_modules

    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary)
    with fastgen.patched(["dedup"]):
        harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=4)
    assert all(m.beam_size == 1 for m in cross_attention_modules(model))
    torch.manual_seed(0)
    with fastgen.patched(["dedup"]):  # and a later beam-1 run on the same model is unaffected
        harness.assert_same_fairseq_generation(model, dictionary, sample, features=["dedup"], beam_size=1, max_len_b=4)


def test_fairseq_bart_is_left_to_its_own_beamable_attention(caplog):
    """fairseq's BART already shares encoder outputs across beams: pass through, no warning."""
    import argparse
    import logging

    from fairseq.models.bart import BARTModel
    from fairseq.models.bart.model import bart_base_architecture

    _, dictionary = harness.tiny_fairseq_transformer()
    args = argparse.Namespace(
        encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_layers=2, encoder_attention_heads=4,
        decoder_embed_dim=32, decoder_ffn_embed_dim=64, decoder_layers=2, decoder_attention_heads=4,
        max_source_positions=64, max_target_positions=64,
    )  # fmt: skip
    bart_base_architecture(args)

    class _Task:
        source_dictionary = target_dictionary = dictionary

    torch.manual_seed(0)
    model = BARTModel.build_model(args, _Task()).eval()
    sample = harness.tiny_fairseq_sample(dictionary)
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        harness.assert_same_fairseq_generation(model, dictionary, sample, features=["dedup"], beam_size=3, max_len_b=6)
    assert not [r for r in caplog.records if "dedup" in r.getMessage()]


# ----------------------------------------------------------- models that read per-beam encoder state


@pytest.fixture
def dedup_fallbacks(monkeypatch):
    """Reasons the dedup patch handed a call to upstream (``fallback`` warns only once per process)."""
    from fastgen.optimizer.fairseq import dedup

    reasons: list[str] = []
    monkeypatch.setattr(dedup, "fallback", lambda feature, reason: reasons.append(reason))
    return reasons


def _tiny_args(**overrides):
    import argparse

    return argparse.Namespace(
        encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_layers=2, encoder_attention_heads=4,
        decoder_embed_dim=32, decoder_ffn_embed_dim=64, decoder_layers=2, decoder_attention_heads=4,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_source_positions=256, max_target_positions=256, **overrides,
    )  # fmt: skip


class _Task:
    def __init__(self, dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def _widen(model):
    with torch.no_grad():  # as harness.tiny_fairseq_transformer: a tiny model at fairseq's init ignores its input
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed" not in name:
                param.mul_(2.0)
    return model.eval()


def _assert_upstream_ran(model, dictionary, spy_encoder_reorder, dedup_fallbacks, reason):
    """Generation equals upstream's (hypotheses, scores, attention), and upstream's path ran: one
    fallback naming ``reason``, and the encoder output expanded to B·M rows as upstream does."""
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    reference, candidate = harness.assert_same_fairseq_generation(
        model, dictionary, sample, features=["dedup"], beam_size=4, max_len_b=10
    )
    for ref_hypos, cand_hypos in zip(reference, candidate, strict=True):
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["attention"], cand["attention"])
    assert len({tuple(h[0]["tokens"].tolist()) for h in candidate}) > 1, "outputs ignore the input"
    assert dedup_fallbacks and all(reason in r for r in dedup_fallbacks), dedup_fallbacks
    spy_encoder_reorder.clear()
    with fastgen.patched(["dedup"]):
        harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=10)
    assert spy_encoder_reorder[0] == 3 * 4  # upstream's path: encoder_out expanded to B·M rows


def test_pointer_generator_runs_upstream(spy_encoder_reorder, dedup_fallbacks):
    """fairseq's pointer-generator decoder reads ``encoder_out["src_tokens"]`` per beam (its own
    ``test_transformer_pointer_generator`` failed with fastgen): exact-class allow-list -> upstream."""
    pg = pytest.importorskip("fairseq.examples.pointer_generator.pointer_generator_src.transformer_pg")
    _, dictionary = harness.tiny_fairseq_transformer()
    args = _tiny_args(source_position_markers=0, share_all_embeddings=True, force_generation=None)
    pg.transformer_pointer_generator(args)
    torch.manual_seed(0)
    model = _widen(pg.TransformerPointerGeneratorModel.build_model(args, _Task(dictionary)))
    _assert_upstream_ran(model, dictionary, spy_encoder_reorder, dedup_fallbacks, "not fairseq's Transformer")


def test_decoder_subclass_reading_src_tokens_runs_upstream(spy_encoder_reorder, dedup_fallbacks):
    """Any subclass of fairseq's TransformerDecoder goes upstream; this one reads ``src_tokens`` per beam."""
    from fairseq.models.transformer import TransformerDecoder, TransformerEncoder, TransformerModel, base_architecture

    class SourceAwareEncoder(TransformerEncoder):
        def forward(self, src_tokens, src_lengths=None, return_all_hiddens: bool = False, token_embeddings=None):
            out = super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
            out["src_tokens"] = [src_tokens]
            return out

    class SourceAwareDecoder(TransformerDecoder):
        def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
            x, extra = super().forward(prev_output_tokens, encoder_out, incremental_state, **kwargs)
            src_tokens = encoder_out["src_tokens"][0]
            assert src_tokens.shape[0] == x.shape[0], "needs one source row per hypothesis"
            boost = torch.zeros_like(x).scatter_(2, src_tokens[:, None, :].expand(-1, x.shape[1], -1), 0.5)
            return x + boost, extra  # favour copying source tokens

    class SourceAwareModel(TransformerModel):
        @classmethod
        def build_encoder(cls, args, src_dict, embed_tokens):
            return SourceAwareEncoder(args, src_dict, embed_tokens)

        @classmethod
        def build_decoder(cls, args, tgt_dict, embed_tokens, no_encoder_attn=False):
            return SourceAwareDecoder(args, tgt_dict, embed_tokens, no_encoder_attn=no_encoder_attn)

    _, dictionary = harness.tiny_fairseq_transformer()
    args = _tiny_args(share_all_embeddings=True, share_decoder_input_output_embed=True)
    base_architecture(args)
    torch.manual_seed(0)
    model = _widen(SourceAwareModel.build_model(args, _Task(dictionary)))
    _assert_upstream_ran(model, dictionary, spy_encoder_reorder, dedup_fallbacks, "not fairseq's Transformer")


def test_cross_self_attention_runs_upstream(spy_encoder_reorder, dedup_fallbacks):
    """``cross_self_attention`` concatenates encoder output with each beam's states (crashed with fastgen)."""
    from fairseq.models.transformer import TransformerModel, base_architecture

    _, dictionary = harness.tiny_fairseq_transformer()
    args = _tiny_args(cross_self_attention=True, share_all_embeddings=True, share_decoder_input_output_embed=True)
    base_architecture(args)
    torch.manual_seed(0)
    model = _widen(TransformerModel.build_model(args, _Task(dictionary)))
    _assert_upstream_ran(model, dictionary, spy_encoder_reorder, dedup_fallbacks, "cross_self_attention")


def test_plain_transformer_still_takes_the_dedup_path(fairseq_transformer, spy_encoder_reorder, dedup_fallbacks):
    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    reference, candidate = harness.assert_same_fairseq_generation(
        model, dictionary, sample, features=["dedup"], beam_size=4, max_len_b=10
    )
    for ref_hypos, cand_hypos in zip(reference, candidate, strict=True):
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["attention"], cand["attention"])
    assert not dedup_fallbacks
    spy_encoder_reorder.clear()
    with fastgen.patched(["dedup"]):
        harness.fairseq_generate(model, dictionary, sample, beam_size=4, max_len_b=10)
    assert all(n < 3 for n in spy_encoder_reorder), spy_encoder_reorder  # never expanded to B·M rows


def test_print_alignment_generator_runs_upstream(fairseq_transformer, spy_encoder_reorder, dedup_fallbacks):
    """``--print-alignment`` uses ``SequenceGeneratorWithAlignment`` (alignment heads read per beam): upstream."""
    from fairseq.sequence_generator import SequenceGeneratorWithAlignment

    model, dictionary = fairseq_transformer
    sample = harness.tiny_fairseq_sample(dictionary, batch=3, length=10)
    results = []
    for scope in (fastgen.unpatched(), fastgen.patched(["dedup"])):
        generator = SequenceGeneratorWithAlignment([model], dictionary, beam_size=4, max_len_b=10)
        spy_encoder_reorder.clear()
        with scope, torch.no_grad():
            results.append(generator.generate([model], sample))
        assert spy_encoder_reorder[0] == 3 * 4  # encoder_out expanded to B·M rows: upstream's path
    for ref_hypos, cand_hypos in zip(*results, strict=True):
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["tokens"], cand["tokens"])
            assert ref["alignment"] == cand["alignment"] and ref["alignment"]  # hard alignment: (src, tgt) pairs
            assert torch.equal(ref["positional_scores"], cand["positional_scores"])
    assert len(dedup_fallbacks) == 1 and "SequenceGeneratorWithAlignment" in dedup_fallbacks[0]
