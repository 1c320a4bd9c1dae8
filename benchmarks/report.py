"""Renders ``benchmarks/results/*.json`` as the README's headline table and the documentation's tables.

python -m benchmarks.report          # rewrite the headline table between the README markers

The documentation site fills its ``<!-- generated:NAME -->`` markers through :func:`fill_generated`
(``docs/hooks.py`` calls it while MkDocs builds), so no measured number there is typed by hand.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _row(r: dict, notes: list[str]) -> str | None:
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
        f"{_cache_ratio(r)} | {identical} | "
        f"{r['environment'].get('git_commit') or '?'} |"
    )


def _device(env: dict) -> str:
    threads = env.get("torch_threads")
    return env["device"] if "cpu_count" not in env else f"{machine(env)}, {threads} thread(s)"


# Where a result may record the CPU's instruction set (benchmarks.measure.environment() gained it in
# issue 25's time; older results lack it). A list of flags, a mapping flag -> bool, or a string.
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
    return {**m, "device": m.get("cpu", m.get("device", "?")), "torch_threads": m.get("torch_default_threads")}


def _cache_ratio(r: dict) -> str:
    """The KV cache fastgen shrank: cross-attention (encoder-decoder) or self-attention (decoder-only)."""
    cross = r.get("cross_attention_cache_ratio")
    if cross is not None:
        return f"cross {cross:.3f}"
    own = r.get("self_attention_cache_ratio")
    return "—" if own is None else f"self {own:.3f}"


def table(results: list[dict] | None = None) -> str:
    """The headline table: every generation scenario's upstream vs fastgen result."""
    notes: list[str] = []
    if results is None:
        results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    rows = [_row(r, notes) for r in results]
    header = (
        "| scenario | device | batch×input→new, dtype | upstream tok/s | fastgen tok/s | speedup "
        "| KV cache (fastgen/upstream) | identical | commit |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    footnotes = ["", *(f"({i}) {note}" for i, note in enumerate(notes, 1))] if notes else []
    return "\n".join([header, *[r for r in rows if r], *footnotes])


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


def tables_by_machine() -> str:
    """The headline table once per device and CPU kind."""
    parts = []
    for name, results in _by_machine(sorted(RESULTS.glob("*.json"))).items():
        body = table([r for _, r in results])
        if body.count("\n") > 1:  # more than the header: some generation scenario ran there
            parts.append(f"### {name}\n\n{body}")
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
        lines = [f"### {name}", "", "| file | command | torch threads | commit | load (1 min) |", "|---" * 5 + "|"]
        for path, r in results:
            env = _environment(r)
            threads = env.get("torch_threads", env.get("torch_default_threads", "?"))
            command = str(r.get("command", "?")).replace("|", "\\|")
            lines.append(f"| `{path.name}` | `{command}` | {threads} | {env.get('git_commit') or '?'} | {_load(r)} |")
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
    return readme_table(sorted(RESULTS.glob(f"{prefix}*.json")))


def _cli_pipeline() -> str:
    from benchmarks.cli_pipeline import readme_table

    return readme_table(json.loads((RESULTS / "cli-pipeline-cpu.json").read_text()))


def _ctranslate2() -> str:
    from benchmarks.ctranslate2_compare import readme_table

    return readme_table(RESULTS)


def trained() -> str:
    """Every ``trained_agreement-*.json``: per decoding mode and candidate, agreement, BLEU/chrF and CPU time."""
    lines = [
        "| CPU | threads | mode | candidate | sentences = upstream | tokens = upstream | BLEU | chrF "
        "| process CPU (median) | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(RESULTS.glob("trained_agreement-*.json")):
        r = json.loads(path.read_text())
        for mode, entry in r["modes"].items():
            load = entry["load_average"]
            for name, c in entry["candidates"].items():
                lines.append(
                    f"| {machine(r['environment'])} | {r['threads']} | {mode} | {name} "
                    f"| {100 * c['vs_upstream']['sequence_match']:.1f}% "
                    f"| {100 * c['vs_upstream']['token_agreement']:.2f}% "
                    f"| {c['bleu']:.2f} | {c['chrf']:.2f} | {c['median_cpu_seconds']:.2f} s "
                    f"| {load['start'][0]:.1f}–{load['end'][0]:.1f} |"
                )
    return "\n".join(lines)


def trained_model() -> str:
    """The trained model's held-out scores (``train_small_model-*.json`` through the agreement JSON)."""
    lines = [
        "| held-out tokens | cross-entropy (nats) | predictive entropy (nats) | argmax accuracy |",
        "|---|---|---|---|",
    ]
    for path in sorted(RESULTS.glob("trained_agreement-*.json"))[:1]:
        held = json.loads(path.read_text())["model"]["held_out"]
        for name, scores in (("all", held), ("masked", held["masked_tokens"]), ("copied", held["copied_tokens"])):
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
    return f"`int8` is in this build ({default}): add it to the features as for `fast_gemm` above."


#: ``<!-- generated:NAME -->`` or ``<!-- generated:NAME:ARG -->`` -> the markdown that replaces it.
GENERATED: dict[str, Callable[..., str]] = {
    "results": tables_by_machine,
    "result-files": result_files,
    "beam-steps": lambda: beam_steps_tables(),
    "speculative": _speculative,
    "continuous-encoder-decoder": lambda: _continuous("encoder-decoder"),
    "continuous-decoder-only": lambda: _continuous("decoder-only"),
    "cli-pipeline": _cli_pipeline,
    "ctranslate2": _ctranslate2,
    "features": features,
    "int8": int8,
    "trained": trained,
    "trained-model": trained_model,
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
    readme.write_text(_replace_block(readme.read_text(), BEGIN, END, table()))


if __name__ == "__main__":
    main()
