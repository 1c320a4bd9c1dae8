"""What a benchmark run records: wall time, peak memory, KV-cache bytes, environment facts.

The shared harness of ``benchmarks/``: :func:`alternate` times variants in alternating rounds,
:func:`result_header` / :func:`write_result` start and write the result JSON, :func:`environment`
records the machine; each benchmark file keeps only what is its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _RssSampler(threading.Thread):
    """Samples this process's resident set every few ms: CPU peak memory of one call."""

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = self.base = _rss_bytes()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._done.wait(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _rss_bytes()) - self.base


def rotating_order(names: list[str], rounds: int) -> Iterator[str]:
    """Each variant once per round, each round starting one variant later, so that drift (load, warm
    caches, allocator state) hits every variant alike."""
    for r in range(rounds):
        yield from names[r % len(names) :] + names[: r % len(names)]


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages: on a shared machine, how far to trust a timing."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclasses.dataclass
class Rounds:
    """What :func:`alternate` measured: each variant's last output, the rest of what ``run`` returned per
    timed round (in round order), and the load average before the first and after the last timed round."""

    outputs: dict[str, Any]
    measured: dict[str, list[tuple]]
    load_average: dict[str, list[float]]

    def column(self, name: str, index: int = 0) -> list:
        """Measurement ``index`` of every timed round of variant ``name``."""
        return [m[index] for m in self.measured[name]]


def alternate(run: Callable[[str], tuple], names: list[str], rounds: int) -> Rounds:
    """Times variants the one way this project trusts: one untimed warm-up call each (allocator, lazy
    imports, calibrations), then ``rounds`` rounds in :func:`rotating_order`, so drift hits all alike.

    ``run(name)`` returns ``(output, *measurements)``.
    """
    outputs = {name: run(name)[0] for name in names}
    measured: dict[str, list[tuple]] = {name: [] for name in names}
    start = load_average()
    for name in rotating_order(names, rounds):
        outputs[name], *rest = run(name)
        measured[name].append(tuple(rest))
    return Rounds(outputs, measured, {"start": start, "end": load_average()})


def result_header(benchmark: str, argv: list[str] | None) -> dict[str, Any]:
    """The fields every result JSON starts with: the benchmark, the exact command that wrote it, when."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "benchmark": benchmark,
        "command": f"python -m benchmarks.{benchmark} " + " ".join(args),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Writes a result JSON (``benchmarks/results/`` holds the committed ones the docs are generated from)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float, int]:
    """Run ``fn`` once: (result, seconds, peak memory in bytes above the memory before the call).

    On CUDA the peak is ``max_memory_allocated`` minus what was allocated before; on CPU it
    is the peak resident set sampled during the call minus the resident set before it.
    """
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        sampler = _RssSampler()
        sampler.start()
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if device == "cuda" else sampler.stop()
    return result, seconds, peak


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an expanded view costs nothing extra)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _layer_tensors(cache: Any) -> list[torch.Tensor]:
    """Every K/V tensor a cache layer holds: ``keys``/``values`` and, for fastgen's shared-prompt layers,
    the ``prefix_keys``/``prefix_values`` kept once per input (``keys``/``values`` are then the suffix)."""
    tensors = []
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "prefix_keys", "prefix_values"):
            tensors.append(getattr(layer, name, None))
    return [t for t in tensors if t is not None]


def kv_cache_bytes(cache: Any) -> dict[str, int]:
    """Self- and cross-attention cache bytes of an HF 5.x cache (``EncoderDecoderCache`` or ``DynamicCache``)."""
    if cache is None:
        return {}
    if hasattr(cache, "self_attention_cache"):
        return {
            "self_attention": _storage_bytes(_layer_tensors(cache.self_attention_cache)),
            "cross_attention": _storage_bytes(_layer_tensors(cache.cross_attention_cache)),
        }
    return {"self_attention": _storage_bytes(_layer_tensors(cache))}


def environment(device: str) -> dict[str, Any]:
    """Device and versions, so a result can be compared only with like results."""
    import transformers

    import fastgen

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fastgen": fastgen.__version__,
        "git_commit": _git_commit(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if device == "cuda":
        facts["device"] = torch.cuda.get_device_name()
        facts["cuda"] = torch.version.cuda
    else:
        facts["device"] = _cpu_name()
        facts["cpu_count"] = os.cpu_count()
        facts["cpu_isa"] = cpu_isa()
        facts["cpu_kind"] = cpu_kind(facts["cpu_isa"])
    return facts


#: The instruction-set extensions that decide GEMM speed, recorded with every CPU result.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8")


def cpu_isa() -> list[str]:
    """Which of :data:`ISA_FLAGS` this CPU has: results of AVX2 and AVX-512 machines differ."""
    from fastgen.ops.int8_linear import cpu_flags

    return [flag for flag in ISA_FLAGS if flag in cpu_flags()]


def cpu_kind(isa: list[str]) -> str:
    """The widest of amx / avx512 / avx2 the CPU has (a short name for result files)."""
    kinds = (("amx", "amx_int8"), ("avx512", "avx512f"), ("avx2", "avx2"))
    return next((kind for kind, flag in kinds if flag in isa), "cpu")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _git_commit() -> str | None:
    if os.environ.get("FASTGEN_GIT_COMMIT"):  # a copy of the tree without .git (a lent GPU machine)
        return os.environ["FASTGEN_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        # Result files a benchmark run writes itself do not make the measured code dirty.
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results", ":!README.md"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def length_summary(lengths: list[int], width: int = 8) -> dict[str, Any]:
    """Min, max, mean and a histogram in bins of ``width`` of output lengths (the continuous-batching JSONs)."""
    counts: dict[str, int] = {}
    for value in sorted(lengths):
        low = (value // width) * width
        counts[f"{low}-{low + width - 1}"] = counts.get(f"{low}-{low + width - 1}", 0) + 1
    return {
        "min": min(lengths),
        "max": max(lengths),
        "mean": statistics.mean(lengths),
        f"histogram_by_{width}": counts,
    }


def run_heading(data: dict[str, Any], lengths_label: str) -> str:
    """The line above a README table: the command, machine, threads, load, commit and output lengths."""
    env, out = data["environment"], data["output_lengths"]
    load = ", ".join(f"{value:.1f}" for value in data["load_1min"])
    threads = f"{env['torch_threads']} torch thread{'s' if env['torch_threads'] != 1 else ''}"
    return (
        f"`{data['command']}` ({env['device']}, {env.get('cpu_count')} cores, {threads}, 1-min load {load}; "
        f"commit {str(env.get('git_commit'))[:7]}; {lengths_label} {out['min']}-{out['max']}, "
        f"mean {out['mean']:.1f}):\n"
    )
