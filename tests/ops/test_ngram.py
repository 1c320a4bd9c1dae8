"""n-gram blocking: every backend against upstream (HF's processors, fairseq's intended semantics)
and against the torch reference, on random rows with planted repeats.

Triton runs under TRITON_INTERPRET=1 where there is no GPU (set in tests/ops/conftest.py); the
CUDA extension and the torch path on CUDA run only with a GPU (marker ``gpu``).
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
    EncoderNoRepeatNGramLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
)

import fastgen
from fastgen.ops import _ext, ngram
from fastgen.ops._dispatch import TritonKernels
from fastgen.ops.ngram import ban_encoder_ngrams, ban_repeated_ngrams

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_RUNS = HAS_TRITON and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
HAS_FAIRSEQ = importlib.util.find_spec("fairseq") is not None
SCORE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOKEN_DTYPES = [torch.int32, torch.int64]

gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

# (backend, device): every implementation that can run here. "torch-sync-free" is the torch path
# that CUDA tensors take (fixed shapes, no nonzero), forced onto CPU so it is tested everywhere.
TARGETS = [
    pytest.param(("torch", "cpu"), id="torch"),
    pytest.param(("torch-sync-free", "cpu"), id="torch-sync-free"),
    pytest.param(
        ("triton", "cuda" if HAS_CUDA else "cpu"),
        id="triton",
        marks=pytest.mark.skipif(not TRITON_RUNS, reason="Triton missing, or no GPU and no TRITON_INTERPRET=1"),
    ),
    pytest.param(("cuda", "cuda"), id="cuda", marks=gpu),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=gpu),
]
# Fewer examples where each one is expensive (the Triton interpreter runs one program at a time).
EXAMPLES = {"torch": 150, "torch-sync-free": 80, "triton": 60, "cuda": 300}


def examples(target: tuple[str, str], scale: float = 1.0) -> settings:
    """Hypothesis settings for one target: its example budget, no deadline (interpreter, first calls)."""
    return settings(
        max_examples=max(5, int(EXAMPLES[target[0]] * scale)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def ban(
    target: tuple[str, str],
    tokens: torch.Tensor,
    scores: torch.Tensor,
    n: int,
    length: int | torch.Tensor | None = None,
    input_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one backend on copies moved to its device; returns the banned scores on CPU."""
    backend, device = target
    tokens = tokens.to(device)
    scores = scores.clone().to(device)
    if isinstance(length, torch.Tensor):
        length = length.to(device)
    decoder = input_tokens is None
    hay = tokens if decoder else input_tokens.to(device)
    if backend == "torch-sync-free":
        ngram._ban_torch(hay, tokens, scores, n, length, decoder, sync_free=True)
        return scores.cpu()
    if decoder:
        out = ban_repeated_ngrams(tokens, scores, n, length, backend=backend)
    else:
        out = ban_encoder_ngrams(hay, tokens, scores, n, length, backend=backend)
    assert out is scores, "the op must work in place and return its scores argument"
    return out.cpu()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view, so NaN payloads and -0.0 must match too."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = bits(got) != bits(want)
    if diff.any():
        where = diff.nonzero()[:10].tolist()
        detail = ", ".join(f"[{r},{c}] got {got[r, c].item()} want {want[r, c].item()}" for r, c in where)
        pytest.fail(f"{what}: {int(diff.sum())} entries differ: {detail}")


def hf_ban(tokens: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    with fastgen.unpatched():  # upstream's processor, not fastgen's replacement of it
        return NoRepeatNGramLogitsProcessor(n)(tokens.long(), scores.clone())


def plant(tokens: torch.Tensor, n: int, count: int, gen: torch.Generator) -> None:
    """Copy each row's n-gram prefix (its last n-1 tokens) to `count` earlier places, so bans happen."""
    rows, width = tokens.shape
    room = width - 2 * n + 2  # a planted window must end before the prefix starts
    if n < 2 or room <= 0:
        return
    for r in range(rows):
        for i in torch.randint(0, room, (count,), generator=gen).tolist():
            tokens[r, i : i + n - 1] = tokens[r, width - n + 1 :]


@st.composite
def decoder_cases(draw, max_rows: int = 8, max_len: int = 40, negative_ids: bool = False):
    n = draw(st.integers(1, 5))
    rows = draw(st.integers(1, max_rows))
    width = draw(st.integers(0, max_len))
    vocab = draw(st.integers(1, 70))
    alphabet = draw(st.integers(1, vocab + 3))  # small alphabets repeat a lot; > vocab: ids the model can't emit
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tokens = torch.randint(-2 if negative_ids else 0, alphabet, (rows, width), generator=gen)
    plant(tokens, n, draw(st.integers(0, 3)), gen)
    tokens = tokens.to(draw(st.sampled_from(TOKEN_DTYPES)))
    scores = torch.randn(rows, vocab, generator=gen).to(draw(st.sampled_from(SCORE_DTYPES)))
    return SimpleNamespace(tokens=tokens, scores=scores, n=n, gen=gen)


@st.composite
def encoder_cases(draw):
    n = draw(st.integers(1, 5))
    batch, beams = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    width, source_width = draw(st.integers(0, 12)), draw(st.integers(0, 30))
    vocab = draw(st.integers(1, 40))
    alphabet = draw(st.integers(1, vocab))  # HF's encoder processor indexes scores with input ids: keep them < V
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tokens = torch.randint(0, alphabet + 2, (batch * beams, width), generator=gen)
    inputs = torch.randint(0, alphabet, (batch, source_width), generator=gen)
    if n >= 2 and width >= n - 1 and source_width >= n:
        for r in range(batch * beams):  # plant each hypothesis' prefix into its input row
            i = int(torch.randint(0, source_width - n + 2, (1,), generator=gen))
            inputs[r // beams, i : i + n - 1] = tokens[r, width - n + 1 :].clamp(max=alphabet - 1)
    token_dtype = draw(st.sampled_from(TOKEN_DTYPES))
    scores = torch.randn(batch * beams, vocab, generator=gen).to(draw(st.sampled_from(SCORE_DTYPES)))
    return SimpleNamespace(tokens=tokens.to(token_dtype), inputs=inputs.to(token_dtype), scores=scores, n=n, gen=gen)


# --------------------------------------------------------------------------------------------------
# against upstream
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_matches_hf_no_repeat_ngram_processor(target):
    @examples(target)
    @given(case=decoder_cases())
    def check(case):
        got = ban(target, case.tokens, case.scores, case.n)
        assert_same(got, hf_ban(case.tokens, case.scores, case.n), f"n={case.n} tokens={case.tokens.tolist()}")

    check()


@pytest.mark.parametrize("target", TARGETS)
def test_length_matches_hf_on_the_valid_prefix(target):
    """Padded buffers with per-row or scalar valid lengths == HF on each row's valid tokens."""

    @examples(target, 0.6)
    @given(case=decoder_cases(), pad=st.integers(0, 6), per_row=st.booleans())
    def check(case, pad, per_row):
        rows, width = case.tokens.shape
        buffer = torch.cat([case.tokens, torch.randint(0, 5, (rows, pad), generator=case.gen).to(case.tokens)], 1)
        if per_row:
            lengths = torch.randint(-1, width + pad + 2, (rows,), generator=case.gen)  # clamped to [0, L]
            want = case.scores.clone()
            for r in range(rows):
                valid = buffer[r : r + 1, : max(0, min(int(lengths[r]), width + pad))]
                want[r : r + 1] = hf_ban(valid, case.scores[r : r + 1], case.n)
            got = ban(target, buffer, case.scores, case.n, lengths)
            assert_same(got, want, f"n={case.n} lengths={lengths.tolist()} tokens={buffer.tolist()}")
        else:
            got = ban(target, buffer, case.scores, case.n, width)
            assert_same(got, hf_ban(case.tokens, case.scores, case.n), f"n={case.n} length={width}")

    check()


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
@pytest.mark.parametrize("target", TARGETS)
def test_matches_fairseq_intended_semantics(target):
    """fairseq's CPU loop, handed the valid tokens ``tokens[:, :step+1]`` (what its CUDA kernel reads).

    n == 1 is left out: that loop compares the whole row with an empty window (``row[-0:]`` is the
    whole row) and bans nothing, while its CUDA kernel and HF ban every token seen (we do too).
    """
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    @examples(target, 0.5)
    @given(case=decoder_cases(max_len=30), pad=st.integers(1, 6))
    def check(case, pad):
        n = max(case.n, 2)
        rows, width = case.tokens.shape
        if width == 0:
            return
        vocab = case.scores.shape[1]
        tokens = case.tokens.clamp(max=vocab - 1).long()  # fairseq indexes lprobs with every banned id
        buffer = torch.cat([tokens, torch.full((rows, pad), vocab - 1)], 1)  # padded past the step
        step = width - 1
        want = NGramRepeatBlock(n, use_extension=False)._no_repeat_ngram(
            buffer[:, : step + 1], case.scores.clone(), rows, 1, step
        )
        assert_same(ban(target, buffer.to(case.tokens.dtype), case.scores, n, step + 1), want, f"n={n} step={step}")

    check()


@pytest.mark.parametrize("target", TARGETS)
def test_encoder_variant_matches_hf(target):
    @examples(target, 0.6)
    @given(case=encoder_cases())
    def check(case):
        with fastgen.unpatched():
            processor = EncoderNoRepeatNGramLogitsProcessor(case.n, case.inputs.long())
            want = processor(case.tokens.long(), case.scores.clone())
        got = ban(target, case.tokens, case.scores, case.n, input_tokens=case.inputs)
        assert_same(got, want, f"n={case.n} inputs={case.inputs.tolist()} tokens={case.tokens.tolist()}")

    check()


# --------------------------------------------------------------------------------------------------
# against the torch reference: inputs upstream can't take (negative ids, odd lengths, strides)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [t for t in TARGETS if t.values[0][0] != "torch"])
def test_matches_torch_reference(target):
    @examples(target, 0.6)
    @given(case=decoder_cases(negative_ids=True), data=st.data())
    def check(case, data):
        rows, width = case.tokens.shape
        lengths = torch.randint(-2, width + 3, (rows,), generator=case.gen)
        length = data.draw(st.sampled_from([None, width // 2, -1, width + 5, lengths, lengths[:1]]))
        # Score rows with a gap between them: kernels must honour the row stride.
        wide = torch.randn(rows, case.scores.shape[1] + 3, generator=case.gen).to(case.scores.dtype)
        scores = wide[:, : case.scores.shape[1]]
        want = scores.clone()
        ngram._ban_torch(case.tokens, case.tokens, want, case.n, length, True)
        got = ban(target, case.tokens, scores, case.n, length)
        assert_same(got, want, f"n={case.n} length={length}")
        inputs = torch.randint(-1, 8, (1, int(torch.randint(0, 20, (1,)))), generator=case.gen).to(case.tokens)
        want = scores.clone()
        ngram._ban_torch(inputs, case.tokens, want, case.n, length, False)
        assert_same(ban(target, case.tokens, scores, case.n, length, inputs), want, f"encoder n={case.n}")

    check()


@pytest.mark.parametrize("target", TARGETS)
def test_n1_bans_exactly_the_valid_tokens(target):
    """n == 1: each id in [0, V) among a row's valid tokens is banned and nothing else is touched, also
    on a view that skips leading columns (the fairseq patch leaves out the start token that way)."""

    @examples(target, 0.5)
    @given(case=decoder_cases(negative_ids=True), skip=st.integers(0, 2), data=st.data())
    def check(case, skip, data):
        rows, width = case.tokens.shape
        view = case.tokens[:, skip:]  # same storage: row stride > row width when skip > 0
        per_row = torch.randint(-1, width + 2, (rows,), generator=case.gen)
        length = data.draw(st.sampled_from([None, max(width - skip - 1, 0), per_row]))
        vocab = case.scores.shape[1]
        want = case.scores.clone()
        for r in range(rows):
            valid = view.shape[1] if length is None else int(length if isinstance(length, int) else length[r])
            ids = [t for t in view[r, : max(valid, 0)].tolist() if 0 <= t < vocab]
            want[r, ids] = float("-inf")
        assert_same(ban(target, view, case.scores, 1, length), want, f"skip={skip} length={length}")

    check()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("rows", "width", "vocab", "n"),
    [
        (3, 1500, 1000, 3),  # longer than 1024: no thread/window ceiling
        (2, 1100, 517, 4),
        (512, 140, 50265, 3),  # the seeds' shape: batch 128 x beam 4, 140 steps, BART vocab
    ],
)
def test_big_shapes_match_hf(target, rows, width, vocab, n):
    gen = torch.Generator().manual_seed(rows * width + n)
    tokens = torch.randint(0, 40, (rows, width), generator=gen)
    plant(tokens, n, 3, gen)
    scores = torch.randn(rows, vocab, generator=gen)
    want = hf_ban(tokens, scores, n)
    assert (want == float("-inf")).sum() >= rows, "the shape should exercise bans in every row"
    assert_same(ban(target, tokens, scores, n), want, f"{rows}x{width} n={n}")


@pytest.mark.parametrize("target", TARGETS)
def test_edge_cases(target):
    inf = float("-inf")
    scores = torch.zeros(2, 6)
    # n > length bans nothing; n == length compares one window
    tokens = torch.tensor([[1, 2, 1], [3, 3, 3]])
    assert_same(ban(target, tokens, scores, 4), scores, "n > length")
    want = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, inf, 0, 0]])
    assert_same(ban(target, tokens, scores, 3), want, "n == length: one window")
    want = torch.tensor([[0, 0, inf, 0, 0, 0], [0, 0, 0, inf, 0, 0]])
    assert_same(ban(target, tokens, scores, 2), want, "n == 2")
    # n == 1 bans every token seen; ids >= vocab are ignored
    tokens = torch.tensor([[5, 0, 9], [2, 2, 7]])
    want = torch.tensor([[inf, 0, 0, 0, 0, inf], [0, 0, inf, 0, 0, 0]])
    assert_same(ban(target, tokens, scores, 1), want, "n == 1")
    # an all-pad row (pad repeated) bans pad after the prefix "pad pad"; a zero-length row bans nothing
    tokens = torch.tensor([[4, 4, 4, 4], [1, 2, 1, 2]])
    got = ban(target, tokens, scores, 3, torch.tensor([4, 0]))
    assert_same(got, torch.tensor([[0, 0, 0, 0, inf, 0], [0] * 6]), "all-pad / empty rows")
    # untouched entries keep their exact bits (NaN, -0.0, +inf); banned NaN becomes -inf like HF
    odd = torch.tensor([[float("nan"), -0.0, float("inf"), float("nan"), 1.0, 2.0]] * 2)
    tokens = torch.tensor([[3, 1, 3, 0, 3], [5, 5, 5, 5, 5]])
    assert_same(ban(target, tokens, odd, 2), hf_ban(tokens, odd, 2), "special values")
    # no rows, no tokens
    assert ban(target, torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 6), 2).shape == (0, 6)
    assert_same(ban(target, torch.zeros(2, 0, dtype=torch.long), scores, 1), scores, "empty rows")


# --------------------------------------------------------------------------------------------------
# upstream quirks this op deliberately does not copy
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_FAIRSEQ, reason="fairseq is not installed")
def test_fairseq_cpu_fallback_bans_nothing_on_its_padded_buffer():
    """fairseq #4709/#5206: SequenceGenerator hands NGramRepeatBlock the whole (bsz*beam, max_len+2)
    buffer, pad-filled past ``step``; the CPU loop takes its prefix from the *end of the buffer*
    (pads), which never equals a window of real tokens, so nothing is banned. Its CUDA kernel reads
    the first step+1 tokens and bans; with ``length=step + 1`` so does this op, on every backend.
    """
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    pad, step, n = 1, 5, 3
    buffer = torch.full((1, 10), pad)
    buffer[0, : step + 1] = torch.tensor([2, 7, 8, 9, 7, 8])  # "7 8" repeats: 9 must be banned
    lprobs = torch.zeros(1, 12)
    with fastgen.unpatched():  # upstream's forward, not fastgen's fix of it
        upstream = NGramRepeatBlock(n, use_extension=False)(buffer, lprobs.clone(), 1, 1, step)
    assert not upstream.isinf().any(), "upstream fixed its CPU fallback: revisit the fairseq patch"
    ours = ban_repeated_ngrams(buffer, lprobs.clone(), n, step + 1)
    assert ours.isinf().nonzero().tolist() == [[0, 9]]


def test_hf_leaves_scores_alone_and_copies():
    """HF returns a new tensor (its input untouched) once cur_len >= n; this op works in place."""
    tokens, scores = torch.tensor([[1, 2, 1, 2]]), torch.zeros(1, 4)
    with fastgen.unpatched():
        out = NoRepeatNGramLogitsProcessor(2)(tokens, scores)
    assert out is not scores and not scores.isinf().any() and out.isinf().any()
    assert ban_repeated_ngrams(tokens, scores, 2) is scores and scores.isinf().any()


# --------------------------------------------------------------------------------------------------
# dispatch, loading, arguments
# --------------------------------------------------------------------------------------------------


def test_arguments_are_checked():
    tokens, scores = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 5)
    with pytest.raises(ValueError, match="positive"):
        ban_repeated_ngrams(tokens, scores, 0)
    with pytest.raises(ValueError, match="N×L"):
        ban_repeated_ngrams(tokens[:1], scores, 2)
    with pytest.raises(TypeError, match="integer"):
        ban_repeated_ngrams(tokens.float(), scores, 2)
    with pytest.raises(ValueError, match="one value per row"):
        ban_repeated_ngrams(tokens, scores, 2, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="multiple"):
        ban_encoder_ngrams(torch.zeros(3, 4, dtype=torch.long), tokens, scores, 2)


def test_float64_and_int16_go_to_torch():
    tokens, scores = torch.tensor([[1, 2, 1]], dtype=torch.int16), torch.zeros(1, 4, dtype=torch.float64)
    assert ban_repeated_ngrams(tokens, scores, 2)[0, 2] == float("-inf")
    assert ngram._unsupported("triton", tokens, tokens, scores) is not None


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only answers")
def test_dispatch_on_cpu(monkeypatch, caplog):
    tokens, scores = torch.tensor([[1, 2, 1]]), torch.zeros(1, 4)
    assert ngram._choose_backend(None, tokens, tokens, scores) == "torch"
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run this call: tensors on cpu"):
        ban_repeated_ngrams(tokens, scores, 2, backend="cuda")  # an explicit backend is strict
    monkeypatch.setenv("FASTGEN_BACKEND", "cuda")  # the process-wide preference falls back, with a warning
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        assert ban_repeated_ngrams(tokens, scores.clone(), 2)[0, 2] == float("-inf")
    assert "FASTGEN_BACKEND='cuda' cannot run this call (tensors on cpu" in caplog.text
    monkeypatch.setenv("FASTGEN_BACKEND", "torch")
    assert ban_repeated_ngrams(tokens, scores, 2)[0, 2] == float("-inf")
    with pytest.raises(RuntimeError, match="unknown backend"):
        ban_repeated_ngrams(tokens, scores, 2, backend="cutlass")
    report = ngram.available_backends("cpu")
    assert report["torch"] is None and "not CUDA" in report["cuda"]
    assert "without CUDA" in ngram.available_backends("cuda")["cuda"] or "no CUDA" in ngram.available_backends()["cuda"]


def test_import_does_not_load_triton():
    code = "import sys, fastgen.ops.ngram; print('triton' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_triton_import_failure_is_reported_once_and_skipped(monkeypatch, caplog):
    monkeypatch.setattr(ngram, "_TRITON", TritonKernels("fastgen.ops.triton.ngram", "n-gram blocking"))
    monkeypatch.setitem(sys.modules, "fastgen.ops.triton.ngram", None)  # makes the import fail
    with caplog.at_level(logging.WARNING, logger="fastgen"):
        assert ngram._TRITON.load() is None
        assert ngram._TRITON.load() is None
    assert len([r for r in caplog.records if "Triton" in r.getMessage()]) == 1
    tokens, scores = torch.tensor([[1, 2, 1]]), torch.zeros(1, 4)
    assert "failed to import" in ngram._unsupported("triton", tokens, tokens, scores.cuda() if HAS_CUDA else scores)


def test_extension_loader_never_raises(monkeypatch):
    _ext._reset_for_tests()
    try:
        module = _ext.load()
        info = _ext.build_info()
        if module is None:
            assert _ext.unavailable_reason() and info["reason"] == _ext.unavailable_reason()
        if not HAS_CUDA:
            assert module is None and ("without CUDA" in _ext.unavailable_reason() or "no CUDA" in info["reason"])
    finally:
        _ext._reset_for_tests()


def test_extension_loader_reasons(monkeypatch):
    assert _ext._release("2.13.0+cu128") == "2.13.0"
    reason = _ext._check_torch_version(SimpleNamespace(torch_version="1.0.0"))
    assert reason.startswith("fastgen._C was built for torch 1.0.0, running ")

    def broken(name):
        raise ImportError("undefined symbol: _ZN3c104cuda9SetDeviceEa")

    monkeypatch.setattr(_ext.importlib, "import_module", broken)
    module, reason = _ext._import_prebuilt()
    assert module is None and "does not load with torch" in reason and "undefined symbol" in reason
    monkeypatch.setenv("FASTGEN_JIT", "0")
    assert "FASTGEN_JIT=0" in _ext._jit_build()[1]


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"), reason="no nvcc")
def test_cuda_sources_compile():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "check_nvcc.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiled csrc/ngram.cu" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("width", [6000, 7000, 13000])  # int64 rows over 48 KiB read global memory
def test_cuda_long_rows_without_shared_memory(width):
    gen = torch.Generator().manual_seed(width)
    tokens = torch.randint(0, 50, (4, width), generator=gen)
    plant(tokens, 3, 5, gen)
    scores = torch.randn(4, 333, generator=gen)
    for dtype in TOKEN_DTYPES:
        assert_same(ban(("cuda", "cuda"), tokens.to(dtype), scores, 3), hf_ban(tokens, scores, 3), f"L={width}")


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="needs Triton; with a GPU the other tests compile it anyway")
def test_triton_kernel_compiles_for_a_gpu(tmp_path):
    """The interpreter accepts code the compiler rejects: compile every specialisation for sm_90 (no GPU needed)."""
    code = """
import itertools, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastgen.ops.triton.ngram import _ban_ngrams_kernel as kernel
for tok, score, has_lengths, decoder in itertools.product(("i32", "i64"), ("fp32", "fp16", "bf16"), (0, 1), (0, 1)):
    signature = {"hay_ptr": "*" + tok, "hay_stride": "i64", "hay_width": "i64", "tok_ptr": "*" + tok,
                 "tok_stride": "i64", "tok_width": "i64", "len_ptr": "*i64", "len_scalar": "i64",
                 "scores_ptr": "*" + score, "scores_stride": "i64", "vocab": "i64", "n": "i32", "beams": "i64",
                 "HAS_LENGTHS": "constexpr", "DECODER": "constexpr", "BLOCK": "constexpr"}
    constants = {"HAS_LENGTHS": bool(has_lengths), "DECODER": bool(decoder), "BLOCK": 128}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "ptx" in compiled.asm
# Triton specialises an int argument equal to 1 as a constant: n == 1 gets its own compile (no prefix loop).
for has_lengths, decoder in itertools.product((0, 1), (0, 1)):
    signature.update(hay_ptr="*i64", tok_ptr="*i64", scores_ptr="*fp32", n="constexpr")
    constants = {"n": 1, "HAS_LENGTHS": bool(has_lengths), "DECODER": bool(decoder), "BLOCK": 128}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "ptx" in compiled.asm
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("", "fastgen: n-gram blocking: FASTGEN_BACKEND='cuda' cannot run this call"),  # last-resort handler
        (  # fairseq's logging format: the logger name is printed, so no prefix in the message
            "import logging; logging.basicConfig(format='%(levelname)s | %(name)s | %(message)s'); ",
            "WARNING | fastgen | n-gram blocking: FASTGEN_BACKEND='cuda' cannot run this call",
        ),
    ],
    ids=["no-logging-config", "fairseq-format"],
)
def test_warnings_name_fastgen_once(setup, expected):
    code = setup + (
        "import torch; from fastgen.ops.ngram import ban_repeated_ngrams; "
        "ban_repeated_ngrams(torch.tensor([[1, 2, 1]]), torch.zeros(1, 4), 2)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FASTGEN_BACKEND": "cuda", "FASTGEN_DISABLE": "1"}
    if HAS_CUDA:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = [line for line in out.stderr.splitlines() if "FASTGEN_BACKEND" in line]
    assert len(lines) == 1 and expected in lines[0] and lines[0].count("fastgen") == 1, out.stderr
