"""fastgen-serve's engine holds generate's GEMM scopes over a busy spell instead of entering them every step:
the results stay ``generate``'s on each input alone, the scopes are entered once per spell (not per step), and
an idle engine leaves the user's modules as they were (no instance forward left behind)."""

from __future__ import annotations

import threading

import torch

from fastgen.continuous import scheduler
from fastgen.continuous.settings import resolve
from fastgen.serve.engine import Engine, Job
from tests.continuous_cases import alone, eos_model, make_inputs


def _serve(engine: Engine, jobs: list[Job], events: list) -> None:
    done = threading.Semaphore(0)
    for job in jobs:
        job.sink = lambda event, job=job: (events.append((job, event)), done.release()) if event[0] != "tokens" else 0
    engine.submit(jobs)
    for _ in jobs:
        assert done.acquire(timeout=120)


def test_scope_entered_once_per_busy_spell(monkeypatch):
    model = eos_model("bart", gain=4.0)
    kwargs = dict(num_beams=3, max_new_tokens=8)
    settings, reason = resolve(model, kwargs)
    assert reason is None
    entries = []
    stock = scheduler.exact_output_projection
    monkeypatch.setattr(scheduler, "exact_output_projection", lambda model: entries.append(1) or stock(model))
    engine = Engine(model, batch_rows=6)
    engine.start()
    try:
        inputs = make_inputs(7, seed=4)
        events: list = []
        _serve(engine, [Job(ids=ids, settings=settings, kwargs=kwargs, sink=None) for ids in inputs], events)
        steps = engine.stats.steps
        assert steps > 10
        assert 1 <= len(entries) <= 3, (len(entries), steps)  # once per spell, whatever the number of steps
        assert len(events) == len(inputs)
        for job, (kind, result) in events:
            assert kind == "done"
            assert torch.equal(result.sequences, alone(model, job.ids, kwargs).sequences)
        pause = threading.Event()
        for _ in range(100):  # the engine leaves the scope when it finds nothing to do
            if not any("forward" in module.__dict__ for module in model.modules()):
                break
            pause.wait(0.05)
        assert not any("forward" in module.__dict__ for module in model.modules())
    finally:
        engine.stop(30)
