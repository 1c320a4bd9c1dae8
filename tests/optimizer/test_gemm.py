"""The "gemm" feature: output projections in their calibrated exact form, same bits as upstream.

Small block sizes and a calibration forced to keep a blocked or ordered form (when one is identical) make the
tiny models run the path real shapes take; every comparison is exact (``torch.equal``).
"""

import pytest
import torch

import fastgen
from fastgen.ops import linear
from fastgen.optimizer import registry
from fastgen.optimizer.transformers import gemm
from tests import harness
from tests.conftest import HAS_FAIRSEQ
from tests.harness import requires_feature

#: needs the feature's Transformers patch (declared for 5.18+; CI also runs 5.15.1)
HF_GEMM = requires_feature("gemm")
FAMILIES = ("bart", "marian", "t5", "whisper", "gpt2", "llama", "qwen2", "gemma2")
DEFAULT_FEATURES = sorted(set(registry.known_features()) - registry.OPT_IN_FEATURES)
EVERYTHING_BUT_GEMM = [f for f in DEFAULT_FEATURES if f != "gemm"]


@pytest.fixture(autouse=True)
def blocked_path(monkeypatch):
    monkeypatch.setattr(linear, "BLOCK_SIZES", (32, 64))
    monkeypatch.setattr(linear, "CALIBRATE_AFTER", 1)
    monkeypatch.setattr(linear, "MIN_OUT_FEATURES", 64)
    monkeypatch.setattr(linear, "TRIAL_CALLS", 0)  # the kept form serves at once (its trial: test_linear.py)
    monkeypatch.setattr(linear, "pick", lambda medians: next((n for n in medians if n != "linear"), "linear"))
    linear.forget_choices()
    yield
    linear.forget_choices()


def _generate(model, inputs, features, logits=True, **kwargs):
    kwargs = dict(return_dict_in_generate=True, output_logits=logits, output_scores=True, **kwargs)
    if features is None:
        with fastgen.unpatched():
            return model.generate(**inputs, **kwargs), None
    with fastgen.patched(features), fastgen.report() as report:
        return model.generate(**inputs, **kwargs), report


def _assert_identical(reference, candidate, what="logits"):
    assert torch.equal(reference.sequences, candidate.sequences)
    assert len(getattr(reference, what)) == len(getattr(candidate, what))
    for step, (ref, cand) in enumerate(zip(getattr(reference, what), getattr(candidate, what), strict=True)):
        assert torch.equal(ref, cand), f"{what} differ at step {step}: max {(ref - cand).abs().max()}"


@HF_GEMM
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [dict(num_beams=4), dict(), dict(num_beams=3, no_repeat_ngram_size=2)])
def test_logits_bit_identical_to_upstream(family, mode):
    model = harness.tiny_hf_model(family)
    inputs = harness.tiny_inputs(model, batch=3)
    reference, _ = _generate(model, inputs, None, max_new_tokens=6, **mode)
    candidate, report = _generate(model, inputs, ["gemm"], max_new_tokens=6, **mode)
    _assert_identical(reference, candidate)
    assert report.fast_path("gemm"), report
    assert any(c.block is not None or c.order is not None for c in linear.choices().values()), linear.choices()
    assert "forward" not in model.get_output_embeddings().__dict__  # the hook left with the call


@HF_GEMM
@pytest.mark.parametrize("family", ["bart", "gpt2", "t5"])
@pytest.mark.parametrize("tied", [True, False])
def test_with_every_other_feature_the_logits_do_not_change(family, tied):
    """gemm stacks on dedup's ``generate`` hook and runs inside fastgen's beam loop (which returns the
    processed scores, not the raw logits: those, equal bit for bit, carry the projection's bits)."""
    model = harness.tiny_hf_model(family, tie_word_embeddings=tied)
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    inputs = harness.tiny_inputs(model, batch=3)
    kwargs = dict(max_new_tokens=6, num_beams=4, no_repeat_ngram_size=2, logits=False)
    without, _ = _generate(model, inputs, EVERYTHING_BUT_GEMM, **kwargs)
    with_gemm, report = _generate(model, inputs, DEFAULT_FEATURES, **kwargs)
    _assert_identical(without, with_gemm, "scores")
    assert torch.equal(without.sequences_scores, with_gemm.sequences_scores)
    assert report.fast_path("gemm") and report.fast_path("beam"), report


@HF_GEMM
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_fall_back_with_a_reason(dtype, caplog):
    model = harness.tiny_hf_model("bart").to(dtype)
    inputs = harness.tiny_inputs(model, batch=2)
    reference, _ = _generate(model, inputs, None, max_new_tokens=4, num_beams=2)
    candidate, report = _generate(model, inputs, ["gemm"], max_new_tokens=4, num_beams=2)
    _assert_identical(reference, candidate)
    assert ("gemm", f"output embeddings in {dtype} (the exact GEMM forms are for float32)") in report.fell_back
    assert linear.choices() == {}


def test_a_head_with_its_own_forward_or_class_is_left_alone():
    model = harness.tiny_hf_model("gpt2")
    head = model.get_output_embeddings()
    head.forward = torch.nn.Linear.forward.__get__(head)
    assert gemm.head_problem(model)[1] == "output embeddings carry their own instance forward"
    del head.forward

    class Custom(torch.nn.Linear):
        pass

    model.lm_head.__class__ = Custom
    assert gemm.head_problem(model)[1] == "output embeddings are Custom, not torch.nn.Linear"


def test_nested_scopes_install_once_and_remove_at_the_end():
    model = harness.tiny_hf_model("bart")
    head = model.get_output_embeddings()
    with gemm.exact_output_projection(model):
        installed = head.__dict__["forward"]
        with gemm.exact_output_projection(model):
            assert head.__dict__["forward"] is installed
        assert head.__dict__["forward"] is installed
    assert "forward" not in head.__dict__


def test_compiled_head_inside_the_scope_traces_upstream_linear():
    model = harness.tiny_hf_model("gpt2")
    head = model.get_output_embeddings()
    x = torch.randn(4, 1, model.config.n_embd)
    with gemm.exact_output_projection(model):
        explanation = torch._dynamo.explain(head)(x)
        compiled = torch.compile(head, backend="eager", fullgraph=True)
        result = compiled(x)
    assert explanation.graph_break_count == 0
    assert torch.equal(result, torch.nn.functional.linear(x, head.weight))


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("features", [["gemm"], DEFAULT_FEATURES])
def test_fairseq_output_projection_bit_identical(beam, features):
    from fastgen.optimizer import report as report_module

    model, dictionary = harness.tiny_fairseq_transformer(vocab=200)
    sample = harness.tiny_fairseq_sample(dictionary, batch=3)
    others = EVERYTHING_BUT_GEMM if features == DEFAULT_FEATURES else []
    with fastgen.patched(others):
        reference = harness.fairseq_generate(model, dictionary, sample, beam_size=beam, max_len_b=8)
    with fastgen.patched(features), report_module.report() as report:
        candidate = harness.fairseq_generate(model, dictionary, sample, beam_size=beam, max_len_b=8)
    for ref_hypos, cand_hypos in zip(reference, candidate, strict=True):
        for ref, cand in zip(ref_hypos, cand_hypos, strict=True):
            assert torch.equal(ref["tokens"], cand["tokens"])
            assert torch.equal(ref["positional_scores"], cand["positional_scores"])
    assert report.fast_path("gemm"), report
    assert any(c.block is not None or c.order is not None for c in linear.choices().values()), linear.choices()
    # the feed-forward products (32 -> 64) ran exact_linear too, not only the 200-word projection
    assert any(key[1:3] == (64, 32) for key in linear.choices()), linear.choices()


@pytest.mark.parametrize("family", ["bart", "llama"])
def test_every_wide_plain_linear_runs_the_exact_form_during_the_call_only(family, monkeypatch):
    """Without fastgen's ordered kernel, linears with at least ``MIN_OUT_FEATURES`` outputs (64 here) get the
    form; narrower ones keep upstream's forward (exact_linear would run F.linear for them anyway); with it,
    every plain linear does (the kernel serves any width)."""
    model = harness.tiny_hf_model(family)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    wide = [m for m in linears if m.out_features >= linear.MIN_OUT_FEATURES]
    head = model.get_output_embeddings()
    assert len(wide) > 1 and len(wide) < len(linears), (len(wide), len(linears))
    if linear.ordered_kernel() is not None:
        with gemm.exact_output_projection(model):
            assert all("forward" in m.__dict__ for m in linears)
        assert not any("forward" in m.__dict__ for m in linears)
    monkeypatch.setattr(linear, "ordered_kernel", lambda: None)
    with gemm.exact_output_projection(model):
        assert all("forward" in m.__dict__ for m in wide)
        assert not any("forward" in m.__dict__ for m in linears if m not in wide and m is not head)
    assert not any("forward" in m.__dict__ for m in linears)


def test_a_compiled_model_keeps_its_linears_when_the_kernel_arrives(monkeypatch):
    """A compiled forward guards on which linears carry an instance forward: when the ordered kernel's
    background build lands between two calls, a compiled model keeps the set it was traced with (else one
    recompilation); an eager model takes every width at once."""
    from fastgen.optimizer import exact_scope

    model = harness.tiny_hf_model("bart")
    monkeypatch.setattr(linear, "ordered_kernel", lambda: None)
    first = exact_scope.plain_linears(model)
    monkeypatch.setattr(model, "_compiled_call", lambda *args, **kwargs: None, raising=False)
    monkeypatch.setattr(linear, "ordered_kernel", lambda: object())
    assert exact_scope.plain_linears(model) == first
    monkeypatch.delattr(model, "_compiled_call")
    assert len(exact_scope.plain_linears(model)) > len(first)
