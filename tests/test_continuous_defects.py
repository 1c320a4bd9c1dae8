"""Issue 24's defects of continuous batching (items 1, 4, 5 and its listing), each against upstream ``generate``.

1. The default length of an encoder-decoder call: ``generate`` reads ``max_length=20`` as 20 *new* tokens
   (decoder limit 21, capped at ``max_position_embeddings``); explicit ``max_length``, ``max_new_tokens``,
   ``min_length`` and a ``generation_config`` keep their meaning.
4. A compiled forward (``model.forward = torch.compile(model.forward)``, ``model.compile()``) falls back with one
   warning to upstream's result.
5. The per-row position hooks stay inside their call: another thread's ``generate`` (under
   ``fastgen.unpatched()``) and a second ``generate_many`` on the same model see the stock modules.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from transformers import GenerationConfig

import fastgen
from fastgen.continuous import generate_many
from fastgen.optimizer import registry
from tests import harness
from tests.continuous_cases import alone, make_inputs


@pytest.fixture(scope="module")
def plain():
    """Tiny models that rarely emit EOS: most outputs run to the length limit."""
    return {family: harness.tiny_hf_model(family) for family in ("bart", "t5")}


def _same_as_alone(model, inputs, kwargs, results) -> list[int]:
    lengths = []
    for index, (ids, sequences) in enumerate(zip(inputs, results, strict=True)):
        expected = alone(model, ids, kwargs).sequences
        assert torch.equal(sequences, expected), f"input {index}: {sequences.tolist()} != {expected.tolist()}"
        lengths.append(sequences.shape[1])
    return lengths


# ----------------------------------------------------------------------------- item 1: length limits

LENGTH_CASES = {
    "default-greedy": dict(),
    "default-beam2": dict(num_beams=2),
    "max_length-15": dict(num_beams=2, max_length=15),
    "max_new_tokens-9": dict(max_new_tokens=9),
    "min_length-23-default-max": dict(min_length=23),
    "generation_config-max_length-12": dict(generation_config=GenerationConfig(max_length=12, num_beams=2)),
}


@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_length_limits_match_generate_alone(plain, family, case):
    model, kwargs = plain[family], LENGTH_CASES[case]
    inputs = make_inputs(5)
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=4, **kwargs))
    assert "continuous" in rep.ran, rep.fell_back
    lengths = _same_as_alone(model, inputs, kwargs, results)
    if case.startswith("default"):
        assert max(lengths) == 21, lengths  # 20 new tokens after the decoder start token, reached


def test_default_length_is_capped_at_the_position_table():
    """With 16 positions, ``generate``'s default limit is ``min(20 + 1, 16)``; BART forces EOS at its last step."""
    model = harness.tiny_hf_model("bart", max_position_embeddings=16)
    inputs = [ids[:14] for ids in make_inputs(4)]
    results = list(generate_many(model, inputs, batch_rows=4, num_beams=2))
    assert max(_same_as_alone(model, inputs, dict(num_beams=2), results)) == 16


# ----------------------------------------------------------------------------- item 5: hooks confined to the call


def _run_together(*jobs) -> None:
    """Run ``jobs`` in threads at once; re-raise the first exception one of them raised."""
    errors: list[BaseException] = []

    def guarded(job):
        def run():
            try:
                job()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(job)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_unpatched_generate_in_another_thread_sees_the_stock_model(plain, family):
    """While one thread runs generate_many, another runs upstream generate (``unpatched()``, this thread only)
    over and over: both get what each input alone gets."""
    model, kwargs = plain[family], dict(num_beams=2, max_new_tokens=12)
    inputs = make_inputs(8)
    expected = [alone(model, ids, kwargs).sequences for ids in inputs]
    many: list[torch.Tensor] = []
    done = threading.Event()
    upstream_runs = []

    def continuous():
        try:
            many.extend(generate_many(model, inputs, batch_rows=4, **kwargs))
        finally:
            done.set()

    def upstream():
        while not done.is_set() or len(upstream_runs) < 4:
            index = len(upstream_runs) % len(inputs)
            ids = inputs[index]
            with fastgen.unpatched(), torch.inference_mode():
                out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **kwargs)
            upstream_runs.append(index)
            assert torch.equal(out, expected[index]), f"upstream generate on input {index} in the other thread"

    _run_together(continuous, upstream)
    assert all(torch.equal(a, b) for a, b in zip(many, expected, strict=True))


def test_two_generate_many_calls_on_one_t5_at_once(plain):
    model, kwargs = plain["t5"], dict(num_beams=2, max_new_tokens=12)
    first, second = make_inputs(6, seed=1), make_inputs(6, seed=2)
    expected = {
        name: [alone(model, ids, kwargs).sequences for ids in inputs]
        for name, inputs in (("first", first), ("second", second))
    }
    got: dict[str, list[torch.Tensor]] = {}

    def job(name, inputs, rows):
        return lambda: got.__setitem__(name, list(generate_many(model, inputs, batch_rows=rows, **kwargs)))

    _run_together(job("first", first, 4), job("second", second, 6))
    for name, results in got.items():
        assert all(torch.equal(a, b) for a, b in zip(results, expected[name], strict=True)), name


def test_two_interleaved_generate_many_streams_in_one_thread(plain):
    """Re-entrant: two streams on one model advanced in turns in one thread (each result pulled lazily)."""
    model, kwargs = plain["bart"], dict(num_beams=2, max_new_tokens=12)
    first, second = make_inputs(5, seed=3), make_inputs(5, seed=4)
    streams = [
        generate_many(model, first, batch_rows=2, **kwargs),
        generate_many(model, second, batch_rows=4, **kwargs),
    ]
    got = [[], []]
    for _ in range(5):
        for which, stream in enumerate(streams):
            got[which].append(next(stream))
    for results, inputs in zip(got, (first, second), strict=True):
        _same_as_alone(model, inputs, kwargs, results)


# ----------------------------------------------------------------------------- item 4: compiled forward


@pytest.mark.parametrize("how", ["forward", "module"])
def test_compiled_model_falls_back_to_generate_with_one_warning(monkeypatch, caplog, how):
    """``generate`` steps aside for a compiled model; generate_many too (it crashed: under compilation the
    attention got every beam's query rows against one cross K/V row per input). The eager backend keeps the
    test fast; Dynamo traces the forward all the same."""
    model = harness.tiny_hf_model("bart")
    if how == "forward":
        model.forward = torch.compile(model.forward, backend="eager", dynamic=False)
    else:
        model.compile(backend="eager", dynamic=False)
    kwargs = dict(num_beams=2, max_new_tokens=3)
    inputs = [torch.arange(3, 9), torch.arange(4, 10)]  # one shape: one trace
    monkeypatch.setattr(registry._state, "warned", set())
    with caplog.at_level(logging.WARNING, logger="fastgen"), fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=2, **kwargs))  # static batches of one input
    assert "continuous" not in rep.ran and rep.fell_back
    warnings = [r.getMessage() for r in caplog.records if "[continuous]" in r.getMessage()]
    assert len(warnings) == 1 and "compiled (torch.compile)" in warnings[0], warnings
    _same_as_alone(model, inputs, kwargs, results)


def test_an_instance_forward_on_the_hooked_path_falls_back(plain):
    """A module whose copy would call the shared original (another library's hook) cannot carry the hooks."""
    model = harness.tiny_hf_model("bart")
    decoder = model.get_decoder()
    decoder.forward = decoder.forward  # an instance forward bound to the original module
    with fastgen.report() as rep:
        results = list(generate_many(model, make_inputs(2), batch_rows=2, num_beams=2, max_new_tokens=5))
    assert "continuous" not in rep.ran and "own forward" in str(rep.fell_back), rep.fell_back
    _same_as_alone(model, make_inputs(2), dict(num_beams=2, max_new_tokens=5), results)


# ----------------------------------------------------------------------------- listing and switching


def test_continuous_batching_is_listed_and_switchable():
    import fastgen.continuous.settings as switches  # applies the pending switch patch

    assert "continuous" in fastgen.known_features()
    assert "continuous" not in registry.OPT_IN_FEATURES
    rows = [row for row in fastgen.status() if row.feature == "continuous"]
    assert [row.state for row in rows] == ["applied"], rows
    assert "continuous" in str(fastgen.status())
    assert switches.switched_on()
    with fastgen.unpatched():
        assert not switches.switched_on()
    others = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES - {"continuous"})
    with fastgen.patched(others):
        assert not switches.switched_on()
        assert next(r for r in fastgen.status() if r.feature == "continuous").state.startswith("disabled")
    assert switches.switched_on()


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_beams=2, max_new_tokens=8), dict(do_sample=True, top_k=20, max_new_tokens=8)],
    ids=["beam2", "sample"],
)
@pytest.mark.parametrize("off", ["not-selected", "unpatched"])
def test_switched_off_runs_generate_on_each_input_alone(off, kwargs):
    """Off, generate_many runs ``generate`` per input (each sampled input under its seed ``S + i``): the results
    continuous batching gives, without its loop and without a fallback warning."""
    model = harness.tiny_hf_model("bart")
    inputs = make_inputs(4)
    others = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES - {"continuous"})
    seed = 11 if kwargs.get("do_sample") else None
    on = list(generate_many(model, inputs, batch_rows=4, seed=seed, **kwargs))
    scope = fastgen.patched(others) if off == "not-selected" else fastgen.unpatched()
    with scope, fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=4, seed=seed, **kwargs))
    assert "continuous" not in rep.ran and not rep.fell_back, str(rep)
    for index, (ids, got, continuous) in enumerate(zip(inputs, results, on, strict=True)):
        if seed is not None:
            torch.manual_seed(seed + index)
        expected = alone(model, ids, kwargs).sequences
        assert torch.equal(got, expected) and torch.equal(continuous, expected), index


def test_fastgen_features_selects_continuous_batching():
    code = (
        "import fastgen, fastgen.continuous.settings as s; "
        "print(s.switched_on(), 'continuous' in fastgen.known_features())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTGEN_")}
    settings = [{}, {"FASTGEN_FEATURES": "dedup,ngram"}, {"FASTGEN_FEATURES": "continuous"}, {"FASTGEN_DISABLE": "1"}]
    # Four fresh interpreters (each reads the environment at import, ~4 s of imports): started together.
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env | extra
        )
        for extra in settings
    ]
    outputs = []
    for extra, run in zip(settings, runs, strict=True):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, (extra, err[-2000:])
        outputs.append(out.strip())
    assert outputs == ["True True", "False True", "True True", "False True"]


def test_the_cli_keeps_static_batches_when_switched_off(caplog):
    """``fastgen-generate-hf`` asks :func:`resolve` whether to stream; off, it says why and keeps static batches."""
    from fastgen.cli import continuous_hf

    model = harness.tiny_hf_model("bart")
    others = sorted(set(fastgen.known_features()) - registry.OPT_IN_FEATURES - {"continuous"})
    # chosen=False: asked for (--continuous-batching), so the speed rule (static for this tiny model) stays out
    assert continuous_hf.serves(model, dict(num_beams=2), chosen=False) is not None
    with fastgen.patched(others), caplog.at_level(logging.INFO, logger=continuous_hf.logger.name):
        assert continuous_hf.serves(model, dict(num_beams=2), chosen=False) is None
    assert "feature 'continuous' is switched off" in caplog.text


def test_a_hooked_module_shared_with_the_encoder_falls_back():
    """The private copy follows the first path to a module: one shared with the encoder (reached first through
    it) would leave the decoder's stock, so such a model is not served rather than served wrong."""
    model = harness.tiny_hf_model("bart")
    model.get_encoder().embed_positions = model.get_decoder().embed_positions
    with fastgen.report() as rep:
        list(generate_many(model, make_inputs(2), batch_rows=2, num_beams=2, max_new_tokens=4))
    assert "continuous" not in rep.ran and "shared with another part" in str(rep.fell_back), rep.fell_back
