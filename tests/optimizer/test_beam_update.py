"""The beam loop's steps c-f in C++ (``fastgen_cpu::beam_update_``): upstream's bits.

``generate`` with the C++ bookkeeping (``FASTGEN_NATIVE_BEAM=1``) and with the torch ops it replaces (``=0``)
must return equal sequences, sequence scores and beam indices, bit for bit, over the settings that steer those
steps: end-of-sequence lists, length penalties of both signs, ``early_stopping`` True / False / "never",
several returned sequences, n-gram bans, padding and inputs that finish at different steps and leave the batch.
Against upstream: the same tokens. With other stopping criteria upstream's loop runs (fastgen's loop takes only
the length limit and end-of-sequence tokens).
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import fastgen
from fastgen.ops import cpu_kernels
from tests import harness

pytestmark = [
    harness.requires_feature("beam"),
    pytest.mark.skipif(not cpu_kernels.available(build=False), reason="fastgen's CPU kernels are not built"),
]

NOTE = "beam bookkeeping: C++ (fastgen_cpu.beam_update_)"

CASES = {
    "beam4": dict(num_beams=4, max_new_tokens=10),
    "beam3-ngram2-two-returned": dict(num_beams=3, no_repeat_ngram_size=2, num_return_sequences=2, max_new_tokens=9),
    "early-eos-lp0.5": dict(num_beams=4, max_new_tokens=12, eos_token_id=[harness.EOS, 7, 11], length_penalty=0.5),
    "early-stopping-true": dict(num_beams=3, max_new_tokens=12, eos_token_id=list(range(3, 40)), early_stopping=True),
    "never-lp2": dict(num_beams=3, max_new_tokens=10, eos_token_id=list(range(3, 25)), early_stopping="never",
                      length_penalty=2.0),
    "never-lp-negative": dict(num_beams=2, max_new_tokens=10, eos_token_id=list(range(3, 25)),
                              early_stopping="never", length_penalty=-1.0),
    "min-length": dict(num_beams=4, min_new_tokens=5, max_new_tokens=8, eos_token_id=list(range(3, 30))),
}  # fmt: skip


@pytest.fixture(scope="module", params=["bart", "marian"])
def model(request: pytest.FixtureRequest):
    return harness.non_degenerate(harness.tiny_hf_model(request.param))


def _generate(model, inputs, native: bool, monkeypatch: pytest.MonkeyPatch, **kwargs):
    monkeypatch.setenv("FASTGEN_NATIVE_BEAM", "1" if native else "0")
    with fastgen.report() as report, torch.no_grad():
        out = model.generate(**inputs, return_dict_in_generate=True, output_scores=True, **kwargs)
    return out, report


@pytest.mark.parametrize("case", CASES)
def test_the_cpp_bookkeeping_is_bit_identical_to_the_torch_ops(model, case, monkeypatch):
    inputs = harness.tiny_inputs(model, batch=4, length=10)
    python, python_report = _generate(model, inputs, False, monkeypatch, **CASES[case])
    native, native_report = _generate(model, inputs, True, monkeypatch, **CASES[case])
    assert NOTE in native_report.ran.get("beam", []) and NOTE not in python_report.ran.get("beam", [])
    assert torch.equal(native.sequences, python.sequences)
    assert torch.equal(native.sequences_scores, python.sequences_scores)
    assert torch.equal(native.beam_indices, python.beam_indices)
    assert all(torch.equal(a, b) for a, b in zip(native.scores, python.scores, strict=True))
    with fastgen.unpatched(), torch.no_grad():
        upstream = model.generate(**inputs, return_dict_in_generate=True, output_scores=True, **CASES[case])
    assert torch.equal(native.sequences, upstream.sequences)
    torch.testing.assert_close(native.sequences_scores, upstream.sequences_scores, atol=1e-5, rtol=1e-5)


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_sequences_alone_leave_the_batch_lazily_under_the_cpp_bookkeeping(model, monkeypatch):
    inputs = harness.tiny_inputs(model, batch=5, length=10)
    kwargs = dict(num_beams=3, max_new_tokens=16, eos_token_id=list(range(3, 30)), early_stopping=True)
    with torch.no_grad():
        monkeypatch.setenv("FASTGEN_NATIVE_BEAM", "0")
        python = model.generate(**inputs, **kwargs)
        monkeypatch.setenv("FASTGEN_NATIVE_BEAM", "1")
        with fastgen.report() as report:
            native = model.generate(**inputs, **kwargs)
    assert NOTE in report.ran.get("beam", []) and "finished inputs left the batch" in report.ran.get("beam", [])
    assert torch.equal(native, python)


def test_the_op_rejects_tensors_it_does_not_know():
    b, m, k, length = 1, 2, 4, 6
    args = [
        torch.zeros(b, k), torch.zeros(b, k, dtype=torch.long), torch.zeros(b, k, dtype=torch.long),
        torch.zeros(b, m, length, dtype=torch.long), torch.zeros(b, m), torch.zeros(b, m, length, dtype=torch.int32),
        torch.zeros(b, m, length, dtype=torch.long), torch.zeros(b, m), torch.zeros(b, m, length, dtype=torch.int32),
        torch.zeros(b, m, dtype=torch.bool), torch.ones(b, 1, dtype=torch.bool), None, False, 1, 1, length, 1.0, 0,
        torch.zeros(b, dtype=torch.long),
    ]  # fmt: skip
    rows, hits = torch.ops.fastgen_cpu.beam_update_(*args)
    assert rows.shape == (b * m,) and hits.shape == (b, k)
    args[4] = torch.zeros(b, m, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="running_scores"):
        torch.ops.fastgen_cpu.beam_update_(*args)


def test_unknown_stopping_criteria_keep_the_torch_ops(model, monkeypatch):
    """Other criteria fall back to upstream's loop entirely (fastgen's loop takes only the two it knows)."""
    inputs = harness.tiny_inputs(model, batch=2, length=8)
    criteria = StoppingCriteriaList([_Never()])
    _, report = _generate(model, inputs, True, monkeypatch, num_beams=3, max_new_tokens=6, stopping_criteria=criteria)
    assert NOTE not in report.ran.get("beam", [])
