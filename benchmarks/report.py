"""Renders ``benchmarks/results/*.json`` as the README's headline table and the documentation's tables.

python -m benchmarks.report          # rewrite the README's results and compatibility tables between their markers

The documentation site fills its ``<!-- generated:NAME -->`` markers through :func:`fill_generated`
(``scripts/mkdocs_hooks.py`` calls it while MkDocs builds), so no measured number there is typed by hand.
"""

from __future__ import annotations

import contextlib
import functools
import html
import json
import re
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COMPAT_BEGIN, COMPAT_END = "<!-- compat-table -->", "<!-- /compat-table -->"
VERSIONS_BEGIN, VERSIONS_END = "<!-- versions -->", "<!-- /versions -->"


def _row(r: dict, notes: list[str], date: str = "?") -> str | None:
    """One table row; a result whose outputs differ on purpose gets a numbered note in ``notes``."""
    if "baseline" not in r or "speedup" not in r:
        return None  # not a generation result (e.g. an op micro-benchmark)
    s, b, f = r["settings"], r["baseline"], r["fastgen"]
    identical = "yes" if r["identical_outputs"] else "NO"
    if r.get("outputs_note") and not r["identical_outputs"]:
        note = f"{r['scenario']} ({_device(_environment(r))}): {r['outputs_note']}"
        if note not in notes:
            notes.append(note)
        identical = f"{identical.lower()}, on purpose ({notes.index(note) + 1})"
    features = r.get("features", "all")
    name = r["scenario"] if features == "all" else f"{r['scenario']} ({', '.join(features)} only)"
    return (
        f"| {name} | {_device(_environment(r))} | {s['batch']}×{s['input_len']}→{s['new_tokens']} "
        f"{s['dtype']} | {b['new_tokens_per_s']:.1f} | {f['new_tokens_per_s']:.1f} | **{r['speedup']:.2f}×** | "
        f"{_cache_ratio(r)} | {identical} | {date} |"
    )


def _device(env: dict) -> str:
    threads = env.get("torch_threads")
    return env["device"] if "cpu_count" not in env else f"{machine(env)}, {threads} thread(s)"


# Where a result may record the CPU's instruction set (older results lack it). A list of flags, a mapping
# flag -> bool, or a string.
ISA_KEYS = ("cpu_isa", "isa", "isa_flags", "cpu_flags")


def cpu_kind(env: dict) -> str:
    """The CPU kind a result was measured on (its instruction-set flags), or "unknown CPU kind".

    Results from CPUs of different kinds (AVX2 vs AVX-512/AMX) must not be read side by side.
    """
    for key in ISA_KEYS:
        value = env.get(key)
        if isinstance(value, dict):
            value = [flag for flag, present in value.items() if present]
        if isinstance(value, list | tuple):
            flags = [str(flag) for flag in value]
            family = (
                "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
            )
            value = f"{family}: {', '.join(flags)}" if family else ", ".join(flags)
        if value:
            return str(value)
    return "unknown CPU kind"


def short_kind(env: dict) -> str:
    """The CPU's instruction-set family in a few words (``AVX-512 VNNI``), or "CPU kind not recorded"."""
    for key in ISA_KEYS:
        value = env.get(key)
        if isinstance(value, dict):
            value = [flag for flag, present in value.items() if present]
        if isinstance(value, list | tuple) and value:
            flags = {str(flag) for flag in value}
            family = (
                "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
            )
            if family and flags & {"avx512_vnni", "avx_vnni"}:
                family += " VNNI"
            return family or "CPU kind not recorded"
    return "CPU kind not recorded"


def machine(env: dict) -> str:
    """Device and, on a CPU, its kind: the key results are grouped by."""
    if env.get("cuda") or "cpu_count" not in env:
        return str(env.get("device", "unknown device"))
    return f"{env['device']} ({cpu_kind(env)})"


def _environment(r: dict) -> dict:
    """A result's environment; the op micro-benchmarks keep theirs under ``machine``."""
    if "environment" in r:  # some benchmarks record the ISA beside it (ctranslate2_compare: cpu_isa)
        return r["environment"] | {key: r[key] for key in ISA_KEYS if key in r}
    m = r.get("machine", {})
    device = m.get("gpu") if m.get("device") == "cuda" else m.get("cpu", m.get("device", "?"))
    return {**m, "device": device or "?", "torch_threads": m.get("torch_default_threads")}


def _cache_ratio(r: dict) -> str:
    """The KV cache fastgen shrank: cross-attention (encoder-decoder) or self-attention (decoder-only)."""
    cross = r.get("cross_attention_cache_ratio")
    if cross is not None:
        return f"cross {cross:.3f}"
    own = r.get("self_attention_cache_ratio")
    return "—" if own is None else f"self {own:.3f}"


def scenario_table(paths: list[Path]) -> str:
    """Upstream vs fastgen per generation scenario (``benchmarks.run`` results), one row per file."""
    notes: list[str] = []
    rows = [_row(json.loads(p.read_text()), notes, result_date(p)) for p in paths]
    header = (
        "| scenario | device | batch×input→new, dtype | upstream tok/s | fastgen tok/s | speedup "
        "| KV cache (fastgen/upstream) | identical | date |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    footnotes = ["", *(f"({i}) {note}" for i, note in enumerate(notes, 1))] if notes else []
    return "\n".join([header, *[r for r in rows if r], *footnotes])


def _generation_files(cuda: bool | None = None) -> list[Path]:
    paths = [p for p in sorted(RESULTS.glob("*.json")) if "speedup" in json.loads(p.read_text())]
    return [p for p in paths if cuda is None or ("-cuda" in p.name) == cuda]


def table(results: list[dict] | None = None) -> str:
    """The README's results: the CPU modes on the newest CPU runs, the GPU runs, earlier runs folded."""
    current = ctranslate2_current()
    gpu = gpu_generation()
    history = scenario_table(_generation_files(cuda=False))
    return "\n\n".join(
        [
            current,
            gpu,
            '<details markdown="1"><summary>Earlier per-scenario runs of the default features on CPU '
            "(CPU kind not recorded; before fastgen's CPU kernels)</summary>\n\n" + history + "\n\n</details>",
        ]
    )


# The per-step breakdown tables of benchmarks/beam_steps.py (docs/benchmarks/beam-search.md).
_STEP_ROWS = {
    "encoder": "encoder",
    "first_forward": "first forward (prefill)",
    "forwards": "later forwards",
    "cache_reorder": "cache: reorder",
    "cache_removal": "cache: finished inputs removed",
    "cache_other": "cache: other",
    "fold": "fold of the returned cache",
    "beam_step": "beam step (the rest)",
}
_PROFILED = "profiler_outside_forward"
_STEP_COLUMNS = {
    "upstream": "upstream",
    "default": "before: without the loop",
    "default+beam": "after: with the loop (default)",
}


def beam_steps_table(r: dict) -> str:
    """One scenario's breakdown: thread CPU ms per ``generate`` call and share, per-step medians, profiler tops."""
    s, b = r["settings"], r["breakdown"]
    names = [n for n in _STEP_COLUMNS if n in b]
    cpu = {n: b[n]["thread_cpu_ms"] for n in names}
    search = ", ".join(f"{k} {v}" for k, v in s["generate"].items() if k not in ("max_new_tokens", "min_new_tokens"))
    load = r["load_average"]
    lines = [
        f"**{r['scenario']}** ({s['batch']}×{s['input_len']}→{s['new_tokens']}, {search}): thread CPU ms per "
        f"`generate` call (share of the call), medians of {r['rounds']} alternating rounds; load average "
        f"{load['start'][0]} → {load['end'][0]}; identical outputs: {'yes' if r['identical_outputs'] else 'NO'}; "
        f"commit {r['environment'].get('git_commit') or '?'}",
        "",
        "| part | " + " | ".join(_STEP_COLUMNS[n] for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for part, label in _STEP_ROWS.items():
        if all(cpu[n]["totals_median"][part] == 0 for n in names):
            continue
        cells = [f"{cpu[n]['totals_median'][part]:.1f} ({100 * cpu[n]['share'][part]:.1f}%)" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{cpu[n]['totals_median']['total']:.1f}**" for n in names) + " |")
    wall = [f"{b[n]['wall_ms']['totals_median']['total']:.1f}" for n in names]
    lines.append("| total, wall clock | " + " | ".join(wall) + " |")
    for key, label in (("forward", "forward"), ("cache", "cache"), ("beam_step", "beam step")):
        cells = [f"{cpu[n]['per_step_median'][key]:.2f}" for n in names]
        lines.append(f"| per step: {label} | " + " | ".join(cells) + " |")
    tops = [
        "<br>".join(f"{t['op']} {t['self_cpu_ms']:.0f} ms ({t['part']})" for t in b[n][_PROFILED]["top"]) for n in names
    ]
    lines.append("| largest op costs outside the forward (profiler) | " + " | ".join(tops) + " |")
    return "\n".join(lines)


def beam_steps_tables() -> str:
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("beam_steps-*.json"))]
    return "\n\n".join(beam_steps_table(r) for r in results)


def _by_machine(paths: list[Path]) -> dict[str, list[tuple[Path, dict]]]:
    groups: dict[str, list[tuple[Path, dict]]] = {}
    for path in paths:
        r = json.loads(path.read_text())
        groups.setdefault(machine(_environment(r)), []).append((path, r))
    return groups


def tables_by_machine(gpu_only: bool = False) -> str:
    """The per-scenario table once per device and CPU kind (``gpu_only``: the ``*-cuda*`` results alone)."""
    parts = []
    paths = _generation_files(cuda=True if gpu_only else None)
    for name, results in _by_machine(paths).items():
        parts.append(f"### {name}\n\n{scenario_table([path for path, _ in results])}")
    return "\n\n".join(parts)


def _load(r: dict) -> str:
    """The 1-minute load averages a result recorded, as min–max (results name them differently)."""
    values: list[float] = []

    def walk(key: str, value: object, inside: bool = False) -> None:
        inside = inside or "load" in key
        if isinstance(value, dict):
            for k, v in value.items():
                walk(k, v, inside)
        elif inside and isinstance(value, list | tuple):
            nums = [float(v) for v in value if isinstance(v, int | float | str)]
            # [1, 5, 15]-minute triples: keep the 1-minute value; a list of 1-minute samples: keep all
            values.extend(nums[:1] if len(nums) == 3 and "1m" not in key else nums)
        elif inside and isinstance(value, int | float):
            values.append(value)

    walk("", r)
    return f"{min(values):.1f}–{max(values):.1f}" if values else "not recorded"


def result_files() -> str:
    """Every committed result file, grouped by device and CPU kind: command, threads, commit, load."""
    parts = []
    for name, results in _by_machine(sorted(RESULTS.glob("*.json"))).items():
        lines = [
            f"### {name}",
            "",
            "| file | command | torch threads | commit | date | load (1 min) |",
            "|---" * 6 + "|",
        ]
        for path, r in results:
            env = _environment(r)
            threads = env.get("torch_threads", env.get("torch_default_threads", "?"))
            command = str(r.get("command", "?")).replace("|", "\\|")
            lines.append(
                f"| `{path.name}` | `{command}` | {threads} | {_commit_text(env.get('git_commit'))} "
                f"| {result_date(path)} | {_load(r)} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _speculative(name: str) -> str:
    from benchmarks.speculative import markdown_table

    return markdown_table(RESULTS / name)


def _continuous(kind: str) -> str:
    if kind == "encoder-decoder":
        from benchmarks.continuous_batching import readme_table
    else:
        from benchmarks.continuous_decoder_only import readme_table
    prefix = "continuous_batching-" if kind == "encoder-decoder" else "continuous_decoder_only-"
    # GPU results have their own table (cold and warm passes): docs/benchmarks/gpu.md, continuous_gpu()
    return readme_table(sorted(p for p in RESULTS.glob(f"{prefix}*.json") if "-cuda" not in p.name))


def _cli_pipeline() -> str:
    from benchmarks.cli_pipeline import readme_table

    return readme_table(json.loads((RESULTS / "cli-pipeline-cpu.json").read_text()))


def _ctranslate2() -> str:
    from benchmarks.ctranslate2_compare import readme_table

    return readme_table(RESULTS)


def gpu_files(prefix: str) -> list[Path]:
    """The committed GPU results of one benchmark: ``<prefix>-*.json`` with ``-cuda`` in the name."""
    return sorted(p for p in RESULTS.glob(f"{prefix}-*.json") if "-cuda" in p.name)


def _commit(r: dict) -> str:
    return str(_environment(r).get("git_commit") or "?")


def _first_failure(probes: dict, largest: int) -> str:
    """The smallest probed batch above ``largest`` that did not fit: the bound on the true maximum."""
    failed = sorted(int(batch) for batch, fits in probes.items() if not fits and int(batch) > largest)
    return f"{failed[0]} fails" if failed else "no larger probe"


def max_batch() -> str:
    """``max_batch-*-cuda*.json``: the largest batch in a memory budget, upstream vs fastgen, and samples/s there."""
    lines = [
        "| device | scenario | memory limit | dtype | output | upstream: largest batch (bound) "
        "| fastgen: largest batch (bound) | samples/s at those batches: upstream / fastgen (ratio) "
        "| same-batch speedup | identical at upstream's batch | commit |",
        "|---" * 11 + "|",
    ]
    for path in gpu_files("max_batch"):
        r = json.loads(path.read_text())
        s, largest, probes, timing = r["settings"], r["largest_batch"], r["probes"], r["timing"]
        dict_out = s.get("return_dict_in_generate", True)
        output = "`return_dict_in_generate=True`" if dict_out else "sequences only"
        up, fg = timing["upstream@upstream"], timing["fastgen@fastgen"]
        lines.append(
            f"| {machine(_environment(r))} | {r['scenario']} {s['input_len']}→{s['new_tokens']}, "
            f"beam {s['generate']['num_beams']} | {s['budget_gib']:g} GiB | {s['dtype']} | {output} "
            f"| {largest['upstream']} ({_first_failure(probes['upstream'], largest['upstream'])}) "
            f"| {largest['fastgen']} ({_first_failure(probes['fastgen'], largest['fastgen'])}) "
            f"| {up['samples_per_s']:.1f} / {fg['samples_per_s']:.1f} "
            f"(**{r['throughput_ratio_at_largest_batches']:.2f}×**) | {r['speedup_same_batch']:.2f}× "
            f"| {'yes' if r['identical_outputs_at_upstream_batch'] else 'NO'} | {_commit(r)} |"
        )
    return "\n".join(lines)


def graph_step() -> str:
    """``graph_step-*-cuda*.json``: the CUDA-graph decode step against the eager step and upstream, cold and warm."""
    lines = [
        "| device | scenario | dtype | variant | warm s (median) | × upstream | cold s (× warm) | peak GiB "
        "| rows identical to upstream | commit |",
        "|---" * 10 + "|",
    ]
    for path in gpu_files("graph_step"):
        r = json.loads(path.read_text())
        s = r["settings"]
        shape = f"{r['scenario']} {s['batch']}×{s['input_len']}→{s['new_tokens']}, beam {s['generate']['num_beams']}"
        for variant in ("upstream", "fastgen-eager", "fastgen-graphs"):
            v = r[variant]
            lines.append(
                f"| {machine(_environment(r))} | {shape} | {r['dtype']} | {variant} | {v['median_s']:.3f} "
                f"| **{v['speedup_vs_upstream']:.2f}×** | {v['cold_s']:.2f} ({v['cold_over_warm']:.2f}×) "
                f"| {v['peak_memory_bytes'] / 2**30:.2f} | {v['identical_rows_vs_upstream']} | {_commit(r)} |"
            )
    return "\n".join(lines)


def _kernel_name(name: str, width: int = 48) -> str:
    """A kernel's name without ``void``, template arguments and parameters, cut to ``width``."""
    short = re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0]
    return short if len(short) <= width else short[: width - 1] + "…"


def step_profile() -> str:
    """``step_profile-*-cuda*.json``: where a decode step's time goes, per variant (torch.profiler)."""
    parts = []
    for path in gpu_files("step_profile"):
        r = json.loads(path.read_text())
        s = r["settings"]
        search = ", ".join(f"{k} {v}" for k, v in s["generate"].items())
        lines = [
            f"**{s['scenario']}** ({s['batch']}×{s['input_len']}→{s['new_tokens']} new tokens, {search}, "
            f"{s['dtype']}) on {machine(_environment(r))}, commit {_commit(r)}: `{r['command']}`",
            "",
            "| variant | s per `generate` call | ms per new token | device busy (share of wall) "
            "| kernel launches per new token | three largest kinds (device ms) | largest kernel (ms, launches) |",
            "|---" * 7 + "|",
        ]
        for name, p in r["profiles"].items():
            kinds = ", ".join(f"{kind} {p['by_kind_ms'][kind]:.1f}" for kind in p["three_largest"])
            top = p["top"][0]
            lines.append(
                f"| {name} | {p['generate_s']:.3f} | {p['per_new_token_ms']:.2f} "
                f"| **{100 * p['busy_share_of_wall']:.0f}%** ({p['busy_ms']:.0f} of {p['profiled_wall_ms']:.0f} ms) "
                f"| {p['launches_per_new_token']:.0f} | {kinds} "
                f"| `{_kernel_name(top['name'])}` {top['ms']:.1f} ({top['count']}) |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def continuous_gpu() -> str:
    """``continuous_batching-*-cuda*.json``: each variant's first (cold) and last (warm) pass over the file."""
    parts = []
    for path in gpu_files("continuous_batching"):
        r = json.loads(path.read_text())
        c, runs, median = r["config"], r["runs"], r["median"]
        names = [n for n in c["variants"].split(",") if n in runs]
        rounds = len(runs[names[0]])
        lengths, out = r["input_lengths"], r["output_lengths"]
        lines = [
            f"**{c['shape']}**, {c['inputs']} inputs of {lengths['min']}–{lengths['max']} tokens, beam {c['beams']}, "
            f"batch {c['batch_size']} (continuous: {c['batch_size'] * c['beams']} rows), up to {c['max_new_tokens']} "
            f"new tokens (outputs {out['min']}–{out['max']}, mean {out['mean']:.1f}), {c['dtype']}, {rounds} "
            f"round{'s' if rounds > 1 else ''} (first round's order: {' → '.join(names)}) on "
            f"{machine(_environment(r))}, commit {_commit(r)}",
            "",
            "| variant | first round s (cold) | last round s (warm) | tokens | decoder steps | rows/step "
            "| outputs = continuous |",
            "|---" * 7 + "|",
        ]
        for name in names:
            first, last = runs[name][0], runs[name][-1]
            warm = f"{last['seconds']:.2f}" if rounds > 1 else "— (one round)"
            lines.append(
                f"| {name} | {first['seconds']:.2f} | {warm} | {last['tokens']} | {last['decoder_steps']} "
                f"| {last['avg_rows_per_step']:.1f} | {median[name].get('outputs_equal_to_continuous', '-')}/"
                f"{c['inputs']} |"
            )
        if "continuous" in runs:
            ratios = []
            for other in (n for n in names if n != "continuous"):
                cold = runs[other][0]["seconds"] / runs["continuous"][0]["seconds"]
                text = f"continuous vs {other}: cold {cold:.2f}×"
                if rounds > 1:
                    text += f", warm **{runs[other][-1]['seconds'] / runs['continuous'][-1]['seconds']:.2f}×**"
                ratios.append(text)
            lines += ["", "; ".join(ratios)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _ops_ngram(r: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for e in r["results"]:
        source = f", source {e['source_length']}" if "source_length" in e else ""
        shape = f"{e['rows']} hypotheses × {e['length']} tokens{source}, vocab {e['vocab']}, n {e['n']}"
        times = ", ".join(f"{k} {v:.3f}" for k, v in e["median_ms"].items())
        speed = (
            f"op {e['speedup_vs_hf']:g}×, op + copy {e['speedup_vs_hf_with_clone']:g}×, "
            f"patched processor {e['speedup_of_patched_processor']:g}× (vs `hf_processor`)"
        )
        rows.append((f"n-gram blocking ({e['variant']})", shape, times + " ms", speed))
    return rows


def _ops_attention(r: dict) -> list[tuple[str, str, str, str]]:
    s, v = r["shape"], r["variants"]
    shape = (
        f"batch {s['batch']} × {s['group']} beams, {s['heads']} heads, {s['q_len']} query over {s['kv_len']} "
        f"keys, dim {s['dim']}, {s['dtype']}"
    )
    times = ", ".join(f"{k} {x['median_us']:.1f}" for k, x in v.items())
    speed = ", ".join(f"{k} {x['speedup_vs_per_beam_sdpa']:.2f}×" for k, x in v.items() if k != "per_beam_sdpa")
    return [("cross-attention over shared K/V", shape, times + " µs", speed + " (vs `per_beam_sdpa`)")]


def _ops_beam_topk(r: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for e in r["results"]:
        shape = f"batch {e['batch']} × {e['beams']} beams, vocab {e['vocab']}, k {e['k']}"
        times = ", ".join(f"{k} {v:.3f}" for k, v in e["median_ms"].items())
        speed = f"`fastgen_op` {e['speedup_vs_hf']:g}× `hf_step`; with 3-gram blocking {e['speedup_vs_hf_ngram3']:g}×"
        rows.append(("beam top-k step", shape, times + " ms", speed))
    return rows


_OPS = {"ngram_op": _ops_ngram, "attention_op": _ops_attention, "beam_topk_op": _ops_beam_topk}


def ops_gpu() -> str:
    """The op micro-benchmarks measured on a GPU (``ngram_op``, ``attention_op``, ``beam_topk_op``)."""
    lines = ["| op | device | shape | median per call | speedup (as recorded) |", "|---" * 5 + "|"]
    for prefix, rows in _OPS.items():
        for path in gpu_files(prefix):
            r = json.loads(path.read_text())
            for op, shape, times, speed in rows(r):
                lines.append(f"| {op} | {machine(_environment(r))} | {shape} | {times} | {speed} |")
    return "\n".join(lines)


def trained() -> str:
    """Every ``trained_agreement-*.json``: per decoding mode and candidate, agreement, BLEU/chrF and CPU time."""
    lines = [
        "| run | CPU | threads | mode | candidate | sentences = upstream | tokens = upstream | BLEU | chrF "
        "| process CPU (median) | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(RESULTS.glob("trained_agreement-*.json")):
        r = json.loads(path.read_text())
        run = path.stem.removeprefix("trained_agreement-")
        for mode, entry in r["modes"].items():
            load = entry["load_average"]
            for name, c in entry["candidates"].items():
                lines.append(
                    f"| {run} | {machine(r['environment'])} | {r['threads']} | {mode} | {name} "
                    f"| {100 * c['vs_upstream']['sequence_match']:.1f}% "
                    f"| {100 * c['vs_upstream']['token_agreement']:.2f}% "
                    f"| {c['bleu']:.2f} | {c['chrf']:.2f} "
                    + (f"| {c['median_cpu_seconds']:.2f} s " if c["median_cpu_seconds"] is not None else "| – ")
                    + f"| {load['start'][0]:.1f}–{load['end'][0]:.1f} |"
                )
    return "\n".join(lines)


def trained_model() -> str:
    """The trained model's held-out scores (``train_small_model-*.json`` through the agreement JSON)."""
    lines = [
        "| held-out tokens | cross-entropy (nats) | predictive entropy (nats) | argmax accuracy |",
        "|---|---|---|---|",
    ]
    newest = sorted(RESULTS.glob("trained_agreement-*.json"), key=lambda p: result_date(p) + p.name, reverse=True)
    for path in newest[:1]:  # the model the newest run measured
        held = json.loads(path.read_text())["model"]["held_out"]
        parts = [("all", held)] + [(n, held[f"{n}_tokens"]) for n in ("masked", "copied") if f"{n}_tokens" in held]
        for name, scores in parts:
            lines.append(
                f"| {name} ({scores['target_tokens']}) | {scores['cross_entropy_nats_per_token']:.2f} "
                f"| {scores['predictive_entropy_nats_per_token']:.2f} | {100 * scores['argmax_accuracy']:.1f}% |"
            )
        lines.append(f"\nA uniform guess over the vocabulary: {held['uniform_entropy_nats']:.2f} nats.")
    return "\n".join(lines)


def features() -> str:
    """The features this build declares and whether each is on by default (``fastgen.known_features()``)."""
    import fastgen
    from fastgen.optimizer.registry import OPT_IN_FEATURES

    rows = [f"| `{name}` | {'opt-in' if name in OPT_IN_FEATURES else 'on'} |" for name in fastgen.known_features()]
    return "\n".join(["| feature | default |", "|---|---|", *rows])


def int8() -> str:
    """What ``fastgen.known_features()`` says about the int8 mode."""
    import fastgen
    from fastgen.optimizer.registry import OPT_IN_FEATURES

    if "int8" not in fastgen.known_features():
        return (
            "`int8` is **not in this build**: `fastgen.known_features()` does not list it, and "
            '`fastgen.enable(features=[..., "int8"])` raises `ValueError` (unknown feature).'
        )
    default = "opt-in" if "int8" in OPT_IN_FEATURES else "on by default"
    switch = '`fastgen.enable(mode="int8")`, `FASTGEN_MODE=int8` or `--mode int8`'
    return f"`int8` is in this build ({default}): {switch}."


# ----------------------------------------------------------------------------------------- dates


@functools.cache
def _git_log(path: Path, fmt: str) -> str:
    try:
        run = subprocess.run(
            ["git", "log", "-1", f"--format={fmt}", "--", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return run.stdout.strip()


def result_date(path: Path) -> str:
    """When a result was measured (its ``date_utc``), else when it was committed; "?" outside a git checkout."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        recorded = json.loads(path.read_text()).get("date_utc")
        if recorded:
            return str(recorded)[:10]
    return _git_log(path, "%cs") or "?"


def _newest_first(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: int(_git_log(p, "%ct") or 0), reverse=True)


def _commit_text(commit: object) -> str:
    text = str(commit or "?")
    return text.replace("-dirty", " + uncommitted edits")


# -------------------------------------------------------------------------------------- versions


def _constant(relative: str, name: str) -> str:
    match = re.search(rf'^{name}\s*=\s*"([^"]+)"', (ROOT / relative).read_text(), re.M)
    if not match:
        raise KeyError(f'{relative} has no {name} = "..."')
    return match.group(1)


def _lower(spec: str) -> str:
    return re.search(r">=\s*([\d.]+)", spec).group(1)


def _upper_major(spec: str) -> str:
    match = re.search(r"<\s*([\d.]+)", spec)
    return match.group(1) if match else ""


@functools.cache
def versions() -> dict[str, str]:
    """The supported and tested versions, read from the package's metadata and the patch registry's ranges.

    Read from the source files (no import), so the documentation builds without torch.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    extras = {
        re.split(r"[<>=\[ ]", d, maxsplit=1)[0]: d for ds in project["optional-dependencies"].values() for d in ds
    }
    matrix = (ROOT / "scripts" / "test.sh").read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    return {
        "python": project["requires-python"].removeprefix(">="),
        "torch": deps["torch"].removeprefix("torch>="),
        "torch_tested": re.search(r"FASTGEN_TORCH_VERSION:-([\d.]+)", setup).group(1),
        "transformers_dependency": deps["transformers"].removeprefix("transformers"),
        "transformers": _constant("fastgen/optimizer/transformers/patches.py", "HF_VERSIONS"),
        "transformers_newest": _constant("fastgen/optimizer/transformers/contract.py", "NEWEST_TESTED"),
        "transformers_previous": re.search(r"FASTGEN_PREVIOUS_TRANSFORMERS:-([\d.]+)", matrix).group(1),
        "transformers_oldest": re.search(r"transformers==([\d.]+)", matrix).group(1),
        "fairseq": _constant("fastgen/optimizer/fairseq/patches.py", "FAIRSEQ_VERSIONS"),
        "triton": extras["triton"].removeprefix("triton"),
    }


def _span(spec: str) -> str:
    """``>=5.18,<6`` -> ``5.18 – 5.x``; ``>=0.12.2,<0.13`` -> ``0.12``."""
    low, high = _lower(spec), _upper_major(spec)
    if high and "." not in high:
        return f"{'.'.join(low.split('.')[:2])} – {int(high) - 1}.x"
    return ".".join(low.split(".")[:2])


def _below(patch_spec: str, dependency_spec: str) -> str:
    """The releases the dependency admits below the patches' range (``5.15 – 5.17``), or ""."""
    dep_major, dep_minor = (int(x) for x in _lower(dependency_spec).split(".")[:2])
    major, minor = (int(x) for x in _lower(patch_spec).split(".")[:2])
    if (dep_major, dep_minor) >= (major, minor) or dep_major != major:
        return ""
    return f"{major}.{dep_minor} – {major}.{minor - 1}"


def versions_line() -> str:
    """The one supported-versions statement every page uses."""
    v = versions()
    below = _below(v["transformers"], v["transformers_dependency"])
    older = f"; {below} install but run upstream's code" if below else ""
    return (
        f"Python ≥ {v['python']}, torch ≥ {v['torch']}, Transformers {_span(v['transformers'])} "
        f"(`{v['transformers']}`, tested up to {v['transformers_newest']}{older}), "
        f"fairseq {_span(v['fairseq'])} (`{v['fairseq']}`)"
    )


def compat_table() -> str:
    """The compatibility table (README and the compatibility page)."""
    v = versions()
    below = _below(v["transformers"], v["transformers_dependency"])
    return "\n".join(
        [
            "| package | supported | tested | outside the range |",
            "|---|---|---|---|",
            f"| Python | ≥ {v['python']} | {v['python']} | not installable |",
            f"| torch | ≥ {v['torch']} | {'.'.join(v['torch_tested'].split('.')[:2])} (CPU build) | — |",
            f"| Transformers | {_span(v['transformers'])} (`{v['transformers']}`) | up to {v['transformers_newest']} "
            f"(CI: the newest release; {v['transformers_previous']}, fast paths; {v['transformers_oldest']}, "
            f"skip check) | {below}: patches skipped with a reason, upstream runs unchanged |",
            f"| fairseq | {_span(v['fairseq'])} (`{v['fairseq']}`) | ve-fairseq 0.12.3 | patches skipped with a "
            "reason |",
            f"| Triton (optional) | {_span(v['triton'])} (`{v['triton']}`) | kernels under `TRITON_INTERPRET=1` on "
            "CPU | torch path |",
        ]
    )


# ---------------------------------------------------------------------------------------- charts

_COLORS = ("#3f6fb5", "#e0803a", "#4a9b5b", "#9a5fb5", "#8c8c8c", "#c9a227", "#c0504d")


def bar_chart(title: str, bars: list[tuple[str, float, str]], note: str = "") -> str:
    """A horizontal bar chart of ratios as inline SVG (no plotting library; scales to the page's width).

    ``bars`` are ``(label, value, series)``; each series gets a colour and a legend entry, and a dashed line
    marks 1.0× (upstream).
    """
    if not bars:
        return ""
    series = list(dict.fromkeys(s for _, _, s in bars))
    color = {s: _COLORS[i % len(_COLORS)] for i, s in enumerate(series)}
    label_w, bar_w, row_h, top = 330, 380, 22, 46
    width = label_w + bar_w + 70
    height = top + row_h * len(bars) + 30
    vmax = max(max(v for _, v, _ in bars), 1.0) * 1.05
    x = lambda v: label_w + bar_w * v / vmax  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{html.escape(title)}" width="100%" style="height:auto;font-family:sans-serif;font-size:12px">',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{html.escape(title)}</text>',
    ]
    lx = 0
    for s in series:
        out.append(f'<rect x="{lx}" y="26" width="10" height="10" fill="{color[s]}"/>')
        out.append(f'<text x="{lx + 14}" y="35">{html.escape(s)}</text>')
        lx += 24 + 7 * len(s)
    for i, (label, value, s) in enumerate(bars):
        y = top + i * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{html.escape(label)}</text>')
        out.append(
            f'<rect x="{label_w}" y="{y + 3}" width="{x(value) - label_w:.1f}" height="{row_h - 6}" fill="{color[s]}"/>'
        )
        out.append(f'<text x="{x(value) + 4:.1f}" y="{y + 15}">{value:.2f}×</text>')
    one = x(1.0)
    bottom = top + row_h * len(bars)
    out.append(
        f'<line x1="{one:.1f}" y1="{top - 2}" x2="{one:.1f}" y2="{bottom + 2}" stroke="#333" stroke-dasharray="4 3"/>'
    )
    out.append(f'<text x="{one:.1f}" y="{bottom + 16}" text-anchor="middle">1.0× = upstream</text>')
    out.append("</svg>")
    caption = f"<figcaption>{note}</figcaption>" if note else ""
    return '<figure class="fastgen-chart" style="width:100%;max-width:52rem">' + "".join(out) + caption + "</figure>"


# ------------------------------------------------------------------------- CPU modes vs CTranslate2

_CANDIDATES = {
    "fastgen": "exact (default)",
    "fastgen_fast": "fast",
    "fastgen_int8": "int8",
    "ctranslate2": "CT2 fp32",
    "ctranslate2_int8": "CT2 int8",
}
_SEARCH = {
    "beam4-norepeat3": "beam 4, no-repeat 3",
    "beam4": "beam 4",
    "greedy-norepeat3": "greedy, no-repeat 3",
    "greedy": "greedy",
}


def _ctranslate2_files() -> tuple[list[Path], list[Path]]:
    """(current, earlier): the newest result per model, thread count and CPU kind, and the rest."""
    current: dict[tuple, Path] = {}
    earlier: list[Path] = []
    for path in _newest_first(sorted(RESULTS.glob("ctranslate2-*.json"))):
        r = json.loads(path.read_text())
        kind = short_kind(_environment(r))
        key = (r["scenario"], r["threads"], kind)
        if key in current or kind == "CPU kind not recorded":
            earlier.append(path)
        else:
            current[key] = path
    order = sorted(current.values(), key=lambda p: (json.loads(p.read_text())["threads"], p.name))
    return order, sorted(earlier)


def _machine_of(r: dict) -> str:
    env = _environment(r)
    return f"{env.get('device', '?')}, {short_kind(env)}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _where(path: Path, r: dict) -> str:
    env = _environment(r)
    return f"{env.get('device', '?')}, {short_kind(env)}, {result_date(path)}"


def _setting(r: dict, mode: str) -> str:
    return f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}, {_SEARCH.get(mode, mode)}"


def ctranslate2_current() -> str:
    """The CPU modes against upstream and CTranslate2 (CT2) on the newest runs: two narrow tables."""
    files, _ = _ctranslate2_files()
    if not files:
        return ""
    first = json.loads(files[0].read_text())
    s = first.get("settings", {})
    shape = f", {s['batch']}×{s['input_len']}→{s['new_tokens']}" if s else ""
    speed = ["| setting | " + " | ".join(_CANDIDATES.values()) + " |", "|---" * (1 + len(_CANDIDATES)) + "|"]
    versus = [
        "| setting | exact / CT2 fp32 | fast / CT2 fp32 | int8 / CT2 int8 "
        "| tokens = upstream: fast / int8 / CT2 int8 |",
        "|---|---|---|---|---|",
    ]
    loads: list[float] = []
    exact_identical = True
    machines = {_machine_of(json.loads(path.read_text())) for path in files}
    for path in files:
        r = json.loads(path.read_text())
        where = f"{_machine_of(r)}: " if len(machines) > 1 else ""  # rows of several CPUs name theirs
        for mode, e in r["modes"].items():
            m = e["median_wall_seconds"]
            cells = [_x(m["upstream"] / m[c]) if m.get(c) else "–" for c in _CANDIDATES]
            speed.append(f"| {where}{_setting(r, mode)} | " + " | ".join(cells) + " |")
            exact_identical &= all(e["identical_to_upstream"].values())
            agree = [
                (e.get(key) or {}).get("token_agreement") for key in ("fast_mode_vs_upstream", "int8_mode_vs_upstream")
            ]
            agree.append(e.get("ctranslate2_int8_token_agreement"))
            tokens = " / ".join("–" if a is None else f"{100 * a:.0f}%" for a in agree)
            int8 = _x(m["ctranslate2_int8"] / m["fastgen_int8"]) if m.get("fastgen_int8") else "–"
            loads += e["load_average_1min"]
            versus.append(
                f"| {where}{_setting(r, mode)} | **{_x(m['ctranslate2'] / m['fastgen'])}** "
                f"| **{_x(m['ctranslate2'] / m['fastgen_fast'])}** | **{int8}** | {tokens} |"
            )
    place = _where(files[0], first) if len(machines) == 1 else "newest run per CPU"
    head = (
        f"**CPU, {first['scenario']} shape{shape} (equal work forced), {place}**, 1-minute load "
        f"{min(loads):.1f}–{max(loads):.1f}: speed-up over upstream Transformers (wall clock, medians; CT2 = "
        "CTranslate2)"
    )
    exact = "identical to upstream's in every row" if exact_identical else "NOT identical to upstream's in some row"
    against = (
        "Against CTranslate2 on the same converted model (above 1.0× fastgen is faster); the exact mode's tokens "
        f"were {exact}:"
    )
    return "\n".join([head, "", *speed, "", against, "", *versus])


def chart_cpu_modes() -> str:
    files, _ = _ctranslate2_files()
    bars = []
    for path in files:
        r = json.loads(path.read_text())
        for mode, e in r["modes"].items():
            m = e["median_wall_seconds"]
            for key, name in _CANDIDATES.items():
                if m.get(key):
                    bars.append((f"{r['scenario']}, {_setting(r, mode)}", m["upstream"] / m[key], name))
    if not files:
        return ""
    first = json.loads(files[0].read_text())
    return bar_chart(
        "Speed-up over upstream Transformers on CPU (higher is faster)",
        bars,
        f"{_where(files[0], first)}; generated from <code>benchmarks/results/ctranslate2-*.json</code>.",
    )


def ctranslate2_history() -> str:
    """Earlier CTranslate2 comparisons (superseded, or from before results recorded the CPU kind)."""
    _, files = _ctranslate2_files()
    lines = [
        "| file | model | threads | CPU kind | search | exact / CT2 fp32 | fast_gemm / CT2 fp32 | int8 / CT2 int8 "
        "| date |",
        "|---" * 9 + "|",
    ]
    for path in files:
        r = json.loads(path.read_text())
        for mode, e in r["modes"].items():
            m = e["median_wall_seconds"]
            int8 = _x(m["ctranslate2_int8"] / m["fastgen_int8"]) if m.get("fastgen_int8") else "–"
            lines.append(
                f"| `{path.name}` | {r['scenario']} | {r['threads']} | {short_kind(_environment(r))} "
                f"| {_SEARCH.get(mode, mode)} | {_x(m['ctranslate2'] / m['fastgen'])} "
                f"| {_x(m['ctranslate2'] / m['fastgen_fast'])} | {int8} | {result_date(path)} |"
            )
    return "\n".join(lines)


def int8_accuracy() -> str:
    """int8 against fp32 upstream on the newest trained-model run, beside CTranslate2 int8 (a short table)."""
    paths = sorted(RESULTS.glob("trained_agreement-*.json"), key=lambda p: result_date(p) + p.name, reverse=True)
    if not paths:
        return "No trained-model comparison is committed."
    path = paths[0]
    r = json.loads(path.read_text())
    sentences = r.get("test_sentences")
    count = sentences if isinstance(sentences, int) else len(sentences) if isinstance(sentences, list) else "?"
    lines = [
        f"On a small BART trained for the comparison ({count} held-out sentences, {_where(path, r)}; "
        "[details](../benchmarks/trained.md)):",
        "",
        "| search | candidate | sentences = fp32 upstream | tokens = fp32 upstream | BLEU (upstream's) |",
        "|---|---|---|---|---|",
    ]
    names = {"fastgen_int8": "fastgen `int8`", "ctranslate2_int8_float32": "CTranslate2 `int8_float32`"}
    for mode, entry in r["modes"].items():
        upstream_bleu = entry["candidates"].get("upstream", {}).get("bleu")
        for key, name in names.items():
            c = entry["candidates"].get(key)
            if c is None:
                continue
            base = f" ({upstream_bleu:.1f})" if upstream_bleu is not None else ""
            lines.append(
                f"| {_SEARCH.get(mode, mode.replace('beam4', 'beam 4'))} | {name} "
                f"| {100 * c['vs_upstream']['sequence_match']:.1f}% | {100 * c['vs_upstream']['token_agreement']:.1f}% "
                f"| {c['bleu']:.1f}{base} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- GPU


def _current_gpu_files() -> tuple[list[Path], list[Path]]:
    """GPU generation results: those of settings still in force, and those of a setting since turned off."""
    current, stale = [], []
    for path in _generation_files(cuda=True):
        r = json.loads(path.read_text())
        # Decoder-only prompt sharing is off on GPUs since this measurement (FASTGEN_GPU_PROMPT_SHARING=1 turns it on).
        (stale if r.get("cross_attention_cache_ratio") is None else current).append(path)
    return current, stale


def gpu_generation() -> str:
    current, _ = _current_gpu_files()
    lines = [
        "**GPU**: speed-up over upstream Transformers, medians",
        "",
        "| model | device | batch×input→new | dtype | speed-up | tokens identical | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in current:
        r = json.loads(path.read_text())
        s = r["settings"]
        identical = "yes" if r["identical_outputs"] else "not all (fp16 near-ties)"
        lines.append(
            f"| {r['scenario']} | {_environment(r)['device']} | {s['batch']}×{s['input_len']}→{s['new_tokens']} "
            f"| {s['dtype']} | **{r['speedup']:.2f}×** | {identical} | {result_date(path)} |"
        )
    for path, r, v in _graph_step_rows():
        s = r["settings"]
        done, total = v["identical_rows_vs_upstream"].split("/")
        identical = "yes" if done == total else f"{done}/{total} rows (fp16 near-ties)"
        lines.append(
            f"| {r['scenario']}, CUDA-graph step | {_environment(r)['device']} "
            f"| {s['batch']}×{s['input_len']}→{s['new_tokens']} | {r['dtype']} | **{v['speedup_vs_upstream']:.2f}×** "
            f"| {identical} | {result_date(path)} |"
        )
    return "\n".join(lines)


def _graph_step_rows() -> list[tuple[Path, dict, dict]]:
    """``graph_step-<scenario>-b<batch>-cuda-<dtype>.json`` (a suffixed name is a variant run, on the GPU page
    only): (path, result, the graph variant's entry), warm medians against upstream."""
    rows = []
    for path in gpu_files("graph_step"):
        if not re.fullmatch(r"graph_step-.+-b\d+-cuda-(fp16|fp32|bf16)\.json", path.name):
            continue
        r = json.loads(path.read_text())
        rows.append((path, r, r["fastgen-graphs"]))
    return rows


def chart_gpu() -> str:
    current, _ = _current_gpu_files()
    bars = []
    for path in current:
        r = json.loads(path.read_text())
        s = r["settings"]
        bars.append(
            (
                f"{r['scenario']} {s['batch']}×{s['input_len']}→{s['new_tokens']}, {s['dtype']}",
                r["speedup"],
                _environment(r)["device"],
            )
        )
    for _, r, v in _graph_step_rows():
        s = r["settings"]
        label = f"{r['scenario']} {s['batch']}×{s['input_len']}→{s['new_tokens']}, {r['dtype']}, CUDA graphs"
        bars.append((label, v["speedup_vs_upstream"], _environment(r)["device"]))
    return bar_chart(
        "Speed-up over upstream Transformers on a GPU",
        bars,
        "Generated from <code>benchmarks/results/*-cuda*.json</code>.",
    )


def chart_scenarios_cpu() -> str:
    bars = []
    for path in _generation_files(cuda=False):
        r = json.loads(path.read_text())
        features = r.get("features", "all")
        if features != "all":
            continue
        s = r["settings"]
        bars.append(
            (
                f"{r['scenario']} {s['batch']}×{s['input_len']}→{s['new_tokens']}",
                r["speedup"],
                "default features, 1 thread",
            )
        )
    return bar_chart(
        "Per-scenario speed-up over upstream on CPU (default features)",
        bars,
        "Generated from <code>benchmarks/results/&lt;scenario&gt;-cpu.json</code>; CPU kind not "
        "recorded (an AMD EPYC), measured before fastgen's CPU kernels.",
    )


#: ``<!-- generated:NAME -->`` or ``<!-- generated:NAME:ARG -->`` -> the markdown that replaces it.
GENERATED: dict[str, Callable[..., str]] = {
    "results": tables_by_machine,
    "results-gpu": lambda: tables_by_machine(gpu_only=True),
    "result-files": result_files,
    "beam-steps": lambda: beam_steps_tables(),
    "speculative": _speculative,
    "continuous-encoder-decoder": lambda: _continuous("encoder-decoder"),
    "continuous-decoder-only": lambda: _continuous("decoder-only"),
    "max-batch": max_batch,
    "graph-step": graph_step,
    "step-profile": step_profile,
    "continuous-gpu": continuous_gpu,
    "ops-gpu": ops_gpu,
    "cli-pipeline": _cli_pipeline,
    "ctranslate2": _ctranslate2,
    "features": features,
    "int8": int8,
    "trained": trained,
    "trained-model": trained_model,
    "versions": versions_line,
    "compat-table": compat_table,
    "cpu-modes": ctranslate2_current,
    "ctranslate2-history": ctranslate2_history,
    "gpu-generation": gpu_generation,
    "chart-cpu-modes": chart_cpu_modes,
    "chart-gpu": chart_gpu,
    "chart-scenarios-cpu": chart_scenarios_cpu,
    "int8-accuracy": int8_accuracy,
}
_MARKER = re.compile(r"<!-- generated:([\w-]+)(?::([^ ]+))? -->")


def fill_generated(markdown: str) -> str:
    """Replace every generated marker; an unknown name raises, so a typo fails the strict build."""

    def render(match: re.Match) -> str:
        name, arg = match.group(1), match.group(2)
        if name not in GENERATED:
            raise KeyError(f"unknown generated block {name!r} (known: {', '.join(GENERATED)})")
        return GENERATED[name](arg) if arg else GENERATED[name]()

    return _MARKER.sub(render, markdown)


def _replace_block(text: str, begin: str, end: str, body: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def main() -> None:
    readme = ROOT / "README.md"
    text = _replace_block(readme.read_text(), BEGIN, END, table())
    text = _replace_block(text, COMPAT_BEGIN, COMPAT_END, compat_table())
    start, stop = text.index(VERSIONS_BEGIN) + len(VERSIONS_BEGIN), text.index(VERSIONS_END)
    readme.write_text(text[:start] + versions_line() + text[stop:])


if __name__ == "__main__":
    main()
