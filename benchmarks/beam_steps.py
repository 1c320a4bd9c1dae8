"""Where a beam search step's time goes: model forward, cache work, beam step — per variant of beam_loop.

    python -m benchmarks.beam_steps --scenario bart-base|marian|gpt2 [--rounds 3] [--out FILE.json]
    python -m benchmarks.beam_steps --scenario bart-base-varlen   # inputs stop at different steps

The three variants of :mod:`benchmarks.beam_loop` (upstream; the default features without the
``beam`` loop, named "default" from when the loop was opt-in; every default feature, "default+beam")
run the scenario's ``generate`` call (benchmarks.scenarios, forced length; or benchmarks.varlen's
natural stops, where the ``beam`` loop removes finished inputs from the batch) in a rotating order
after a warm-up, in one process. Nothing in the library is edited; the call is timed from outside
by instruments installed once for all variants (so they cost the same in each):

* forward pre/post hooks on the model (the first call of a ``generate`` is the prefill, reported
  apart) and on its encoder;
* wrappers on the cache methods beam search calls, on every ``Cache`` subclass of Transformers'
  ``cache_utils`` and of ``fastgen.models`` that defines them: ``reorder_cache`` (per step),
  ``batch_select_inputs`` / ``batch_select_indices`` (finished inputs leaving the batch),
  ``batch_repeat_interleave`` and ``to_upstream`` (the returned cache folded into upstream's layout);
* the whole ``generate`` call.

Only the outermost instrumented region counts (a cache method calling another is one region). The
beam step is what is left: ``generate`` − encoder − forwards − cache − fold, i.e. log-softmax,
processors, top-k, gathers, stopping criteria and bookkeeping, plus the set-up before the first
forward and the finalisation after the last one (reported apart as well). Both clocks are read at
every boundary: this thread's CPU time (what the code costs) and wall time (on a shared machine
mostly waiting for a core). A separate, untimed run per variant under the torch profiler names the
three largest op costs outside the forward.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import pkgutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers.cache_utils

import fastgen
import fastgen.models
from benchmarks import varlen
from benchmarks.beam_loop import VARIANTS, VARLEN, VARLEN_SETTINGS
from benchmarks.measure import alternate, environment, result_header, write_result
from benchmarks.scenarios import SCENARIOS, Scenario

#: cache method -> the part of the step its time goes to
CACHE_METHODS = {
    "reorder_cache": "cache_reorder",
    "batch_select_inputs": "cache_removal",
    "batch_select_indices": "cache_removal",
    "batch_repeat_interleave": "cache_other",
    "to_upstream": "fold",
}
#: parts of a ``generate`` call, in the order reported; they add up to ``total``
PARTS = (
    "encoder",
    "first_forward",
    "forwards",
    "cache_reorder",
    "cache_removal",
    "cache_other",
    "fold",
    "beam_step",
)
CLOCKS = {"thread_cpu": time.thread_time, "wall": time.perf_counter}
#: label of a region in the torch profiler's trace
LABEL_PREFIX = "beam_steps::"
#: the scenarios this benchmark runs: plain HF scenarios that run on a CPU, and beam_loop's variable-length one
CHOICES = [name for name, s in SCENARIOS.items() if type(s) is Scenario and not s.gpu_only] + [VARLEN]


@dataclasses.dataclass(frozen=True)
class Region:
    """One instrumented region: its part, how many forwards had finished when it began, both clocks."""

    part: str
    segment: int
    start: tuple[float, float]
    end: tuple[float, float]


def _now() -> tuple[float, float]:
    return time.thread_time(), time.perf_counter()


class Recorder:
    """Collects the regions of one ``generate`` call; only the outermost of nested regions counts."""

    def __init__(self, profile: bool = False) -> None:
        self.profile = profile
        self.regions: list[Region] = []
        self.forwards = 0
        self.started = self.finished = (0.0, 0.0)
        self._depth = 0
        self._open: tuple[str, tuple[float, float], Any] | None = None

    def begin(self, part: str) -> None:
        self._depth += 1
        if self._depth == 1:
            label = None
            if self.profile:
                label = torch.profiler.record_function(LABEL_PREFIX + part)
                label.__enter__()
            self._open = (part, _now(), label)

    def end(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._open is not None:
            stop = _now()
            part, start, label = self._open
            if label is not None:
                label.__exit__(None, None, None)
            self.regions.append(Region(part, self.forwards, start, stop))
            self.forwards += part == "forward"
            self._open = None

    def time(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` (one ``generate``) with this recorder active."""
        global _ACTIVE
        _ACTIVE = self
        try:
            self.started = _now()
            result = call()
            self.finished = _now()
        finally:
            _ACTIVE = None
        return result


_ACTIVE: Recorder | None = None


def _begin(part: str) -> None:
    if _ACTIVE is not None:
        _ACTIVE.begin(part)


def _end() -> None:
    if _ACTIVE is not None:
        _ACTIVE.end()


def cache_classes() -> dict[type, list[str]]:
    """Every ``Cache`` subclass in Transformers' ``cache_utils`` and ``fastgen.models`` defining a method of
    :data:`CACHE_METHODS` itself, with those methods."""
    modules = [transformers.cache_utils] + [
        importlib.import_module(f"fastgen.models.{info.name}") for info in pkgutil.iter_modules(fastgen.models.__path__)
    ]
    found: dict[type, list[str]] = {}
    for module in modules:
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, transformers.cache_utils.Cache):
                names = [name for name in CACHE_METHODS if name in vars(obj)]
                if names:
                    found[obj] = names
    return found


def _timed_method(method: Callable[..., Any], part: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _begin(part)
        try:
            return method(*args, **kwargs)
        finally:
            _end()

    return wrapper


@contextlib.contextmanager
def instrumented(model: torch.nn.Module) -> Iterator[list[str]]:
    """Install the hooks and wrappers (inactive unless a :class:`Recorder` is timing); yields what was wrapped."""
    handles = []
    modules = {"forward": model}
    if model.config.is_encoder_decoder:
        modules["encoder"] = model.get_encoder()
    for part, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda *_, part=part: _begin(part)))
        handles.append(module.register_forward_hook(lambda *_: _end(), always_call=True))
    originals = []
    for cls, names in cache_classes().items():
        for name in names:
            originals.append((cls, name, vars(cls)[name]))
            setattr(cls, name, _timed_method(vars(cls)[name], CACHE_METHODS[name]))
    try:
        yield [f"{type(m).__name__} forward ({part})" for part, m in modules.items()] + [
            f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name, _ in originals
        ]
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
        for handle in handles:
            handle.remove()


def breakdown(recorder: Recorder) -> dict[str, dict[str, Any]]:
    """Per clock: the parts of the call in seconds (they add up to ``total``), beam-step time before the first
    and after the last forward, and per-step lists over the steps between two forwards."""
    result = {}
    steps = recorder.forwards
    for c, clock in enumerate(CLOCKS):
        parts = dict.fromkeys(PARTS, 0.0)
        beam = defaultdict(float)  # segment -> time in no region (the beam step)
        cache = defaultdict(float)  # segment -> cache time
        forwards = []
        previous = recorder.started[c]
        for region in recorder.regions:
            beam[region.segment] += region.start[c] - previous
            seconds = region.end[c] - region.start[c]
            if region.part == "forward":
                forwards.append(seconds)
            else:
                parts[region.part] += seconds
                if region.part.startswith("cache"):
                    cache[region.segment] += seconds
            previous = region.end[c]
        beam[steps] += recorder.finished[c] - previous
        parts["first_forward"] = forwards[0] if forwards else 0.0
        parts["forwards"] = sum(forwards[1:])
        parts["beam_step"] = sum(beam.values())
        loop = range(1, steps)  # the gaps between two forwards: one beam step (and cache work) each
        result[clock] = {
            "parts": parts,
            "total": recorder.finished[c] - recorder.started[c],
            "beam_step_before_first_forward": beam[0],
            "beam_step_after_last_forward": beam[steps],
            "per_step": {
                "forward": forwards[1:],
                "cache": [cache[k] for k in loop],
                "beam_step": [beam[k] for k in loop],
            },
        }
    return result


def call_counts(recorder: Recorder) -> dict[str, int]:
    counts = dict.fromkeys(["forward", "encoder", *CACHE_METHODS.values()], 0)
    for region in recorder.regions:
        counts[region.part] += 1
    return counts


def op_costs_outside_forward(profile: Any, n: int = 3) -> dict[str, Any]:
    """From a profile of one call: the ``n`` aten ops with the most self CPU time outside the model's forward
    and encoder, with the part (cache or beam step) they ran in, and the aten self time of each part."""
    inside = {LABEL_PREFIX + "forward", LABEL_PREFIX + "encoder"}
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for event in profile.events():
        if not event.name.startswith("aten::"):
            continue
        part, parent = "beam_step", event.cpu_parent
        while parent is not None and parent.name not in inside:
            if parent.name.startswith(LABEL_PREFIX):
                part = parent.name[len(LABEL_PREFIX) :]
            parent = parent.cpu_parent
        if parent is None:
            totals[event.name, part][0] += event.self_cpu_time_total
            totals[event.name, part][1] += 1
    everything = sum(us for us, _ in totals.values())
    by_part: dict[str, float] = defaultdict(float)
    for (_, part), (us, _) in totals.items():
        by_part[part] += us
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:n]
    return {
        "top": [
            {
                "op": name,
                "part": part,
                "self_cpu_ms": round(us / 1000, 3),
                "calls": calls,
                "share_of_op_time_outside_forward": round(us / everything, 3) if everything else None,
            }
            for (name, part), (us, calls) in top
        ],
        "op_self_cpu_ms_by_part": {part: round(us / 1000, 3) for part, us in sorted(by_part.items())},
    }


def instrumentation_cost(pairs: int = 20000) -> float:
    """Thread CPU seconds of one begin/end pair (an instrumented region), measured on a scratch recorder."""
    recorder = Recorder()
    start = time.thread_time()
    for _ in range(pairs):
        recorder.begin("forward")
        recorder.end()
    return (time.thread_time() - start) / pairs


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds (totals) and over all steps of all rounds (per step), in ms; shares from the sums."""
    summary = {}
    for clock in CLOCKS:
        per_round = [r[clock] for r in rounds]
        totals = {part: _ms(statistics.median(r["parts"][part] for r in per_round)) for part in PARTS}
        totals["total"] = _ms(statistics.median(r["total"] for r in per_round))
        grand = sum(r["total"] for r in per_round)
        summary[f"{clock}_ms"] = {
            "totals_median": totals,
            "share": {part: round(sum(r["parts"][part] for r in per_round) / grand, 4) for part in PARTS},
            "per_step_median": {
                key: _ms(statistics.median(x for r in per_round for x in r["per_step"][key]))
                for key in ("forward", "cache", "beam_step")
            },
            "beam_step_before_first_forward_median": _ms(
                statistics.median(r["beam_step_before_first_forward"] for r in per_round)
            ),
            "beam_step_after_last_forward_median": _ms(
                statistics.median(r["beam_step_after_last_forward"] for r in per_round)
            ),
            "rounds": [{**{p: _ms(r["parts"][p]) for p in PARTS}, "total": _ms(r["total"])} for r in per_round],
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="bart-base", choices=CHOICES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.scenario == VARLEN:
        settings = dict(VARLEN_SETTINGS)
        model, inputs, kwargs, _ = varlen.prepare(**settings, generate=dict(SCENARIOS["bart-base"].generate))
    else:
        settings = SCENARIOS[args.scenario].settings("cpu")
        model, inputs, kwargs = SCENARIOS[args.scenario].build("cpu", torch.float32, settings)
    names = list(VARIANTS)

    def run(variant: str, recorder: Recorder) -> torch.Tensor:
        features = VARIANTS[variant]
        scope = fastgen.unpatched() if features is None else fastgen.patched(features)
        with scope, torch.inference_mode():
            out = recorder.time(lambda: model.generate(**inputs, **kwargs))
        return out if isinstance(out, torch.Tensor) else out.sequences

    def recorded(variant: str) -> tuple[torch.Tensor, dict[str, Any], dict[str, int]]:
        recorder = Recorder()
        out = run(variant, recorder)
        return out, breakdown(recorder), call_counts(recorder)

    with instrumented(model) as wrapped:
        measured = alternate(recorded, names, args.rounds)
        outputs = measured.outputs
        rounds = {name: measured.column(name, 0) for name in names}
        counts = {name: measured.column(name, 1)[-1] for name in names}
        top = {}
        for name in names:  # not among the timed rounds: the profiler's own overhead is large
            profiled = Recorder(profile=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                run(name, profiled)
            top[name] = op_costs_outside_forward(profile)
            parts = breakdown(profiled)["thread_cpu"]
            top[name]["profiled_call_thread_cpu_ms"] = {p: _ms(parts["parts"][p]) for p in PARTS} | {
                "total": _ms(parts["total"])
            }
    region_cost = instrumentation_cost()
    results = {}
    for name in names:
        regions = sum(counts[name].values())
        results[name] = summarize(rounds[name]) | {
            "calls": counts[name],
            "instrumentation_thread_cpu_ms_estimate": _ms(regions * region_cost),
            "profiler_outside_forward": top[name],
        }
    report = result_header("beam_steps", argv) | {
        "scenario": args.scenario,
        "settings": settings | {"generate": kwargs},
        "variants": VARIANTS,
        "environment": environment("cpu"),
        "load_average": measured.load_average,
        "identical_outputs": all(torch.equal(outputs["upstream"], outputs[n]) for n in names),
        "rounds": args.rounds,
        "method": {
            "instrumented": wrapped,
            "parts": {
                "encoder": "the encoder's forward (encoder-decoder models)",
                "first_forward": "the first model forward of the call (the prefill)",
                "forwards": "every later model forward (one per decoding step)",
                "cache_reorder": "reorder_cache (beam search's per-step reorder)",
                "cache_removal": "batch_select_inputs / batch_select_indices (finished inputs leaving the batch)",
                "cache_other": "batch_repeat_interleave",
                "fold": "to_upstream: a returned deduplicated cache folded into upstream's layout",
                "beam_step": "the rest of generate: log-softmax, processors, top-k, gathers, stopping criteria, "
                "bookkeeping, set-up before the first forward and finalisation after the last",
            },
            "per_step": "the steps between two forwards (the last step, which includes finalisation, is excluded)",
            "instrumentation_region_cost_us": round(region_cost * 1e6, 3),
            "profiler": "one more call per variant under torch.profiler (not timed): aten ops' self CPU time outside "
            "the forward and encoder, by op and by part (the profiler's clock is the wall clock); absolute values "
            "include the profiler's overhead, and profiled_call_thread_cpu_ms is that call's own breakdown",
        },
        "breakdown": results,
    }
    if args.scenario == VARLEN:
        report["variable_length"] = {
            "how": varlen.__doc__,
            "natural_lengths_upstream": varlen.natural_lengths(outputs["upstream"], pad=1),
        }
    out = args.out or Path(__file__).resolve().parent / "results" / f"beam_steps-{args.scenario}-cpu.json"
    write_result(out, report)
    for name in names:
        cpu = results[name]["thread_cpu_ms"]
        parts = ", ".join(f"{p} {cpu['totals_median'][p]:.1f}" for p in PARTS)
        sys.stdout.write(f"{name:>13} thread CPU ms: {parts}; total {cpu['totals_median']['total']:.1f}\n")
        sys.stdout.write(f"{'':>13} per step: {cpu['per_step_median']}; profiler: {top[name]}\n")
    load = measured.load_average
    sys.stdout.write(f"identical outputs: {report['identical_outputs']}; load {load['start']} -> {load['end']}\n")


if __name__ == "__main__":
    main()
