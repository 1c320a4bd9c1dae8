"""Beam top-k step: the torch reference against HF's own step (bit for bit, ties included) and
fairseq's ``BeamSearch.step``; every kernel against the reference (Triton under TRITON_INTERPRET=1
where there is no GPU; CUDA and torch-on-CUDA only with one, marker ``gpu``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

import fastgen
from fastgen.ops import beam_topk as op
from fastgen.ops.beam_topk import BeamTopK, beam_topk

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_RUNS = HAS_TRITON and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
HAS_FAIRSEQ = importlib.util.find_spec("fairseq") is not None
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEG_INF = float("-inf")

gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
KERNEL_TARGETS = [
    pytest.param(
        ("triton", "cuda" if HAS_CUDA else "cpu"),
        id="triton",
        marks=pytest.mark.skipif(not TRITON_RUNS, reason="Triton missing, or no GPU and no TRITON_INTERPRET=1"),
    ),
    pytest.param(("cuda", "cuda"), id="cuda", marks=gpu),
]
# BEAM_TOPK_EXAMPLES raises the interpreter budget for a deeper local run (300 passed at commit time).
EXAMPLES = {"triton": int(os.environ.get("BEAM_TOPK_EXAMPLES", 25)), "cuda": 300}


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# upstream's step, written out as HF 5.23 _beam_search does it
# --------------------------------------------------------------------------------------------------


def hf_step(logits, beam_scores, k, processors=None, ids=None) -> BeamTopK:
    """``_beam_search`` steps b–c: fp32 copy, log_softmax, processors, + running scores, topk, // and %."""
    batch, beams = beam_scores.shape
    logits = logits.to(copy=True, dtype=torch.float32)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    if processors is not None:
        with fastgen.unpatched():  # upstream's processors, not fastgen's replacements
            log_probs = processors(ids, log_probs)
    vocab = log_probs.shape[-1]
    log_probs = log_probs.view(batch, beams, vocab) + beam_scores[:, :, None]
    values, flat = torch.topk(torch.reshape(log_probs, (batch, -1)), k=k)
    return BeamTopK(values, flat // vocab, flat % vocab)


def full_values(logits, beam_scores, banned=None) -> torch.Tensor:
    """B×(M·V) exact candidate values (the reference's, before topk)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    op._apply_bans(log_probs, banned, None)
    batch, beams = beam_scores.shape
    return (log_probs.view(batch, beams, -1) + beam_scores[:, :, None]).reshape(batch, -1)


def assert_identical(got: BeamTopK, want: BeamTopK, what: str = "") -> None:
    """Bit-identical scores (NaN included), identical beams and tokens."""
    assert got.scores.dtype == torch.float32 and got.beams.dtype == torch.int64 and got.tokens.dtype == torch.int64
    assert torch.equal(got.scores.view(torch.int32), want.scores.view(torch.int32)), f"{what}: scores differ"
    assert torch.equal(got.beams, want.beams) and torch.equal(got.tokens, want.tokens), f"{what}: indices differ"


# --------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------


@st.composite
def step_cases(draw, vocabs=(1, 2, 3, 7, 31, 127, 257, 1023, 1025, 4097, 16411), dtypes=(torch.float32,)):
    batch, beams = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    vocab = draw(st.sampled_from(vocabs))
    k = draw(st.integers(1, min(3 * beams, beams * vocab)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = batch * beams
    levels = draw(st.sampled_from([None, 2, 7, 40]))  # few levels: planted ties everywhere
    if levels is None:
        logits = torch.randn(rows, vocab, generator=gen) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    else:
        logits = torch.randint(0, levels, (rows, vocab), generator=gen).float() * 0.25
    if draw(st.booleans()):  # duplicate one hypothesis' logits into another: cross-beam ties
        logits[int(torch.randint(0, rows, (1,), generator=gen))] = logits[0]
    neg = draw(st.sampled_from([0.0, 0.0, 0.3]))
    logits[torch.rand(rows, vocab, generator=gen) < neg] = NEG_INF
    if draw(st.integers(0, 5)) == 0:
        logits[int(torch.randint(0, rows, (1,), generator=gen))] = NEG_INF  # an all -inf row: NaN upstream
    first_step = draw(st.booleans())
    if first_step:  # HF's initial scores: beam 0 at 0, the others at -1e9
        scores = torch.zeros(batch, beams)
        scores[:, 1:] = -1e9
    else:
        scores = -torch.rand(batch, beams, generator=gen) * 20
        if levels is not None:
            scores = scores.round()  # equal running scores: ties across beams too
    kind = draw(st.sampled_from(["none", "mask", "shared-mask", "ids", "row-ids", "all-masked-row"]))
    banned = None
    if kind == "mask":
        banned = torch.rand(rows, vocab, generator=gen) < 0.2
    elif kind == "shared-mask":
        banned = torch.rand(vocab, generator=gen) < 0.2
    elif kind == "ids":
        banned = torch.randint(-2, vocab + 2, (draw(st.integers(0, 6)),), generator=gen)
    elif kind == "row-ids":
        banned = torch.randint(-2, vocab + 2, (rows, draw(st.integers(0, 6))), generator=gen)
    elif kind == "all-masked-row":
        banned = torch.zeros(rows, vocab, dtype=torch.bool)
        banned[int(torch.randint(0, rows, (1,), generator=gen))] = True
    dtype = draw(st.sampled_from(dtypes))
    return SimpleNamespace(logits=logits.to(dtype), scores=scores, k=k, banned=banned)


# --------------------------------------------------------------------------------------------------
# the reference against upstream
# --------------------------------------------------------------------------------------------------


@examples(300)
@given(case=step_cases(dtypes=tuple(DTYPES)))
def test_reference_is_hf_step_bit_for_bit(case):
    """Ties (few logit levels, duplicated rows, equal running scores), -inf and NaN rows included."""
    want = hf_step(case.logits, case.scores, case.k)
    if case.banned is not None:  # HF would see these as a processor writing -inf after the log_softmax
        log_probs = torch.log_softmax(case.logits.float(), dim=-1)
        op._apply_bans(log_probs, case.banned, None)
        batch, beams = case.scores.shape
        values, flat = torch.topk(
            (log_probs.view(batch, beams, -1) + case.scores[:, :, None]).reshape(batch, -1), case.k
        )
        want = BeamTopK(values, flat // log_probs.shape[1], flat % log_probs.shape[1])
    assert_identical(beam_topk(case.logits, case.scores, case.k, banned=case.banned), want)


@pytest.mark.parametrize("ties", [False, True])
def test_reference_matches_hf_processors(ties):
    """HF's own mask-type processors (n-gram, bad single-token words, min length, suppress) vs ``banned``."""
    batch, beams, vocab, length = 3, 4, 97, 9
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 12, (batch * beams, length), generator=gen)
    ids[:, -2:] = ids[:, 2:4]  # plant a repeated 3-gram prefix
    logits = torch.randint(0, 3, (batch * beams, vocab), generator=gen).float() if ties else torch.randn(12, vocab)
    scores = -torch.rand(batch, beams, generator=gen).round()
    eos, suppress, bad = [5, 6], [0, 96, 13], [[40], [41], [7]]
    processors = LogitsProcessorList(
        [
            NoRepeatNGramLogitsProcessor(3),
            NoBadWordsLogitsProcessor(bad, eos_token_id=eos),
            MinLengthLogitsProcessor(length + 1, eos_token_id=eos),
            SuppressTokensLogitsProcessor(suppress),
        ]
    )
    with fastgen.unpatched():
        ngram_mask = NoRepeatNGramLogitsProcessor(3)(ids, torch.zeros(batch * beams, vocab)) == NEG_INF
    assert ngram_mask.any(), "the planted prefix must ban something"
    k = 3 * beams  # two EOS ids: HF keeps max(2, 1 + 2) · M
    want = hf_step(logits, scores, k, processors, ids)
    shared = torch.tensor([40, 41, 7, *eos, *suppress])
    got = beam_topk(logits, scores, k, banned=ngram_mask | torch.isin(torch.arange(vocab), shared))
    assert_identical(got, want, "bool mask")
    per_row = torch.cat([torch.where(ngram_mask, torch.arange(vocab), -1), shared.expand(batch * beams, -1)], 1)
    assert_identical(beam_topk(logits, scores, k, banned=per_row), want, "per-row ids")


def test_reference_matches_hf_forced_bos_and_eos():
    batch, beams, vocab = 2, 3, 50
    logits, scores = torch.randn(batch * beams, vocab), -torch.rand(batch, beams)
    one_token = torch.zeros(batch * beams, 1, dtype=torch.long)
    want = hf_step(logits, scores, 2 * beams, LogitsProcessorList([ForcedBOSTokenLogitsProcessor(4)]), one_token)
    assert_identical(beam_topk(logits, scores, 2 * beams, forced=torch.tensor([4])), want, "forced BOS")
    max_length, eos = 6, [3, 9]
    ids = torch.zeros(batch * beams, max_length - 1, dtype=torch.long)
    processors = LogitsProcessorList([ForcedEOSTokenLogitsProcessor(max_length, eos)])
    want = hf_step(logits, scores, 3 * beams, processors, ids)
    got = beam_topk(logits, scores, 3 * beams, forced=torch.tensor(eos), banned=torch.tensor([3]))
    assert_identical(got, want, "forced EOS overrides earlier bans")


def test_torch_topk_tie_rule_on_cpu():
    """What the reference inherits (torch 2.13, CPU): with k·64 <= n the partial sort keeps the
    smallest indices among values tied at the k-th place; the order inside a tied run is not index
    order. Documented in fastgen/ops/beam_topk.py; if this changes, upstream's order changes with it."""
    x = torch.zeros(1, 4 * 5003)
    x[0, 100:110] = 1.0
    values, index = torch.topk(x, 8)
    assert values.eq(1.0).all() and set(index[0].tolist()) == set(range(100, 108))
    x = torch.zeros(1, 4 * 5003)
    values, index = torch.topk(x, 8)
    assert set(index[0].tolist()) == set(range(8))
    out = beam_topk(torch.zeros(4, 5003), torch.zeros(1, 4), 8)
    assert torch.equal(out.beams * 5003 + out.tokens, index)  # the reference reproduces it, order and all


def test_log_probs_top_k_works_in_place():
    """The half for loops that own the log-prob buffer: adds the scores into it, then upstream's topk."""
    log_probs = torch.log_softmax(torch.randn(6, 11), -1)
    scores = -torch.rand(2, 3)
    summed = (log_probs.view(2, 3, 11) + scores[:, :, None]).view(2, -1)
    expected = torch.topk(summed, 6)
    out = op.log_probs_top_k(log_probs, scores, 6)
    assert torch.equal(out.scores, expected.values) and torch.equal(out.beams * 11 + out.tokens, expected.indices)
    assert torch.equal(log_probs.view(2, -1), summed)


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
def test_matches_fairseq_beam_search_step():
    from fairseq.search import BeamSearch

    class Dictionary:
        def pad(self):
            return 1

        def unk(self):
            return 3

        def eos(self):
            return 2

        def __len__(self):
            return 41

    search = BeamSearch(Dictionary())
    batch, beams, vocab, step = 3, 5, 41, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (batch * beams, vocab), generator=gen).float()  # ties
    lprobs = torch.log_softmax(logits, -1).view(batch, beams, vocab)
    scores = -torch.rand(batch, beams, step + 1, generator=gen).round()
    f_scores, f_tokens, f_beams = search.step(step, lprobs.clone(), scores, None, None)
    ours = beam_topk(logits, scores[:, :, step - 1].contiguous(), min(2 * beams, beams * vocab - 1))
    assert (
        torch.equal(ours.scores, f_scores) and torch.equal(ours.tokens, f_tokens) and torch.equal(ours.beams, f_beams)
    )
    f_scores, f_tokens, f_beams = search.step(0, lprobs.clone(), scores, None, None)  # step 0: beam 0 only
    ours = beam_topk(logits.view(batch, beams, vocab)[:, 0], torch.zeros(batch, 1), min(2 * beams, vocab - 1))
    assert (
        torch.equal(ours.scores, f_scores) and torch.equal(ours.tokens, f_tokens) and torch.equal(ours.beams, f_beams)
    )


# --------------------------------------------------------------------------------------------------
# kernels against the reference
# --------------------------------------------------------------------------------------------------


def run_target(target, case) -> BeamTopK:
    backend, device = target
    banned = None if case.banned is None else case.banned.to(device)
    out = beam_topk(case.logits.to(device), case.scores.to(device), case.k, banned=banned, backend=backend)
    return BeamTopK(*(t.cpu() for t in out))


def assert_valid_selection(got: BeamTopK, case, atol: float = 2e-5) -> None:
    """Tie-agnostic equivalence with the reference: same sorted values (to the normaliser's rounding),
    distinct (beam, token) pairs whose exact values are the returned ones, and the kernels' tie rule:
    equal values come by smaller ``beam·V + token``."""
    vocab = case.logits.shape[1]
    ref = beam_topk(case.logits, case.scores, case.k, banned=case.banned, backend="torch")
    close = dict(equal_nan=True, atol=atol, rtol=2e-6)
    torch.testing.assert_close(got.scores, ref.scores, **close)
    flat = got.beams * vocab + got.tokens
    assert ((got.tokens >= 0) & (got.tokens < vocab)).all() and (
        (got.beams >= 0) & (got.beams < case.scores.shape[1])
    ).all()
    for row in flat:
        assert len(set(row.tolist())) == len(row), "a continuation was picked twice"
    exact = full_values(case.logits, case.scores, case.banned).gather(1, flat)
    torch.testing.assert_close(got.scores, exact, **close)
    same = (got.scores[:, 1:] == got.scores[:, :-1]) & ~got.scores[:, 1:].isnan()
    assert (flat[:, 1:] > flat[:, :-1])[same].all(), "equal values must come by smaller beam·V + token"


@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_matches_reference(target):
    @examples(EXAMPLES[target[0]])
    @given(case=step_cases(dtypes=tuple(DTYPES)))
    def check(case):
        assert_valid_selection(run_target(target, case), case)

    check()


@pytest.mark.parametrize("target", KERNEL_TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "beams", "vocab"),
    [(2, 1, 4097), (1, 8, 1000), (2, 4, 16411), pytest.param(3, 4, 50265, marks=pytest.mark.slow)],
)
def test_kernel_is_exact_on_separated_values(target, dtype, batch, beams, vocab):
    """Values far apart (no ties, no rounding collisions): indices exactly the reference's.

    Each row: 2·M planted logits 0, -0.5, -1, ... (exact in every dtype) at random places, the rest
    random below -40."""
    gen = torch.Generator().manual_seed(vocab + beams)
    rows = batch * beams
    logits = -40 - torch.rand(rows, vocab, generator=gen) * 10
    for r in range(rows):
        logits[r, torch.randperm(vocab, generator=gen)[: 2 * beams]] = torch.arange(2 * beams).float() * -0.5
    logits = logits.to(dtype)
    case = SimpleNamespace(
        logits=logits, scores=torch.arange(rows).float().view(batch, beams) * -0.0917, k=2 * beams, banned=None
    )
    got, ref = run_target(target, case), beam_topk(case.logits, case.scores, case.k)
    assert torch.equal(got.beams, ref.beams) and torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.scores, ref.scores, atol=2e-5, rtol=2e-6)


@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_edge_rows(target):
    """All -inf logits (NaN log-probs, as upstream), all-banned rows, k = M·V, V = 1."""
    logits = torch.randn(6, 5)
    logits[2] = NEG_INF
    case = SimpleNamespace(logits=logits, scores=torch.zeros(2, 3), k=15, banned=None)
    got = run_target(target, case)
    ref = beam_topk(case.logits, case.scores, case.k)
    assert got.scores.isnan().sum() == ref.scores.isnan().sum() == 5 and (got.beams[0, :5] == 2).all()
    banned = torch.zeros(6, 5, dtype=torch.bool)
    banned[0] = True
    case = SimpleNamespace(logits=torch.randn(6, 5), scores=torch.zeros(2, 3), k=15, banned=banned)
    assert_valid_selection(run_target(target, case), case)
    case = SimpleNamespace(logits=torch.randn(4, 1), scores=-torch.rand(2, 2), k=2, banned=None)
    assert_valid_selection(run_target(target, case), case)


@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_leaves_logits_alone_and_takes_strided_rows(target):
    backend, device = target
    base = torch.randn(6, 2, 301).to(device)
    logits = base[:, 1]  # rows contiguous, row stride 602
    before = logits.clone()
    got = beam_topk(
        logits, torch.zeros(2, 3, device=device), 6, banned=torch.tensor([0, 5], device=device), backend=backend
    )
    assert torch.equal(logits, before)
    ref = beam_topk(logits.cpu().contiguous(), torch.zeros(2, 3), 6, banned=torch.tensor([0, 5]))
    torch.testing.assert_close(got.scores.cpu(), ref.scores, atol=2e-5, rtol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_torch_path_on_cuda_matches_cpu():
    case = SimpleNamespace(logits=torch.randn(12, 50265), scores=-torch.rand(3, 4), k=8, banned=None)
    got = run_target(("torch", "cuda"), case)
    assert_valid_selection(got, case)


# --------------------------------------------------------------------------------------------------
# dispatch and arguments
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only answers")
def test_dispatch_on_cpu(monkeypatch, caplog):
    logits, scores = torch.randn(2, 9), torch.zeros(1, 2)
    assert op._choose_backend(None, logits, 4) == "torch"
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run this call: tensors on cpu"):
        beam_topk(logits, scores, 4, backend="cuda")
    monkeypatch.setenv("FASTGEN_BACKEND", "cuda")
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        assert_identical(beam_topk(logits, scores, 4), hf_step(logits, scores, 4))
    assert "FASTGEN_BACKEND='cuda' cannot run this call (tensors on cpu" in caplog.text
    with pytest.raises(RuntimeError, match="unknown backend"):
        beam_topk(logits, scores, 4, backend="cutlass")
    assert "float64" in op._unsupported("triton", logits.double(), 4)
    assert f"> {op.KERNEL_MAX_K}" in op._unsupported("triton", logits, op.KERNEL_MAX_K + 1)
    report = op.available_backends("cpu")
    assert report["torch"] is None and "not CUDA" in report["cuda"]


def test_arguments_are_checked():
    logits, scores = torch.randn(4, 5), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="k must be"):
        beam_topk(logits, scores, 11)
    with pytest.raises(ValueError, match="beam_scores"):
        beam_topk(logits, torch.zeros(3, 2), 2)
    with pytest.raises(TypeError, match="banned"):
        beam_topk(logits, scores, 2, banned=torch.zeros(5))
    with pytest.raises(ValueError, match="V = 5"):
        beam_topk(logits, scores, 2, banned=torch.zeros(4, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="forced"):
        beam_topk(logits, scores, 2, forced=torch.tensor([[1]]))


def test_import_does_not_load_triton():
    code = "import sys, fastgen.ops.beam_topk; print('triton' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"), reason="no nvcc")
def test_cuda_source_compiles():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "check_nvcc.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiled csrc/beam_topk.cu" in out.stdout


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="needs Triton; with a GPU the other tests compile it anyway")
def test_triton_kernel_compiles_for_a_gpu(tmp_path):
    """The interpreter accepts code the compiler rejects: compile each specialisation for sm_90."""
    code = """
import itertools, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgen.ops.triton.beam_topk import _retrieve_kernel as kernel
for dtype, has_mask, chunk in itertools.product(("fp32", "fp16", "bf16"), (0, 1), (4096,)):
    signature = {"logits_ptr": "*" + dtype, "logits_stride": "i64", "mask_ptr": "*u8", "mask_stride": "i64",
                 "vocab": "i64", "k": "i32", "cand_values_ptr": "*fp32", "cand_tokens_ptr": "*i64",
                 "chunk_max_ptr": "*fp32", "chunk_sum_ptr": "*fp32", "num_chunks": "i64",
                 "HAS_MASK": "constexpr", "CHUNK": "constexpr"}
    constants = {"HAS_MASK": bool(has_mask), "CHUNK": chunk}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "ptx" in compiled.asm
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
