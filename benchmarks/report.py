"""Regenerates the README's results table from ``benchmarks/results/*.json``.

python -m benchmarks.report          # rewrite the tables between the README markers
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
CT2_BEGIN, CT2_END = "<!-- ctranslate2:begin -->", "<!-- ctranslate2:end -->"


def _row(r: dict, notes: list[str]) -> str | None:
    """One table row; a result whose outputs differ on purpose gets a numbered note in ``notes``."""
    if "baseline" not in r or "speedup" not in r:
        return None  # not a generation result (e.g. an op micro-benchmark)
    s, b, f = r["settings"], r["baseline"], r["fastgen"]
    identical = "yes" if r["identical_outputs"] else "NO"
    if r.get("outputs_note") and not r["identical_outputs"]:
        note = f"{r['scenario']} ({_device(r['environment'])}): {r['outputs_note']}"
        if note not in notes:
            notes.append(note)
        identical = f"{identical.lower()}, on purpose ({notes.index(note) + 1})"
    features = r.get("features", "all")
    name = r["scenario"] if features == "all" else f"{r['scenario']} ({', '.join(features)} only)"
    return (
        f"| {name} | {_device(r['environment'])} | {s['batch']}×{s['input_len']}→{s['new_tokens']} "
        f"{s['dtype']} | {b['new_tokens_per_s']:.1f} | {f['new_tokens_per_s']:.1f} | **{r['speedup']:.2f}×** | "
        f"{_cache_ratio(r)} | {identical} | "
        f"{r['environment'].get('git_commit') or '?'} |"
    )


def _device(env: dict) -> str:
    threads = env.get("torch_threads")
    return env["device"] if "cpu_count" not in env else f"{env['device']}, {threads} thread(s)"


def _cache_ratio(r: dict) -> str:
    """The KV cache fastgen shrank: cross-attention (encoder-decoder) or self-attention (decoder-only)."""
    cross = r.get("cross_attention_cache_ratio")
    if cross is not None:
        return f"cross {cross:.3f}"
    own = r.get("self_attention_cache_ratio")
    return "—" if own is None else f"self {own:.3f}"


def table() -> str:
    notes: list[str] = []
    rows = [_row(json.loads(p.read_text()), notes) for p in sorted(RESULTS.glob("*.json"))]
    header = (
        "| scenario | device | batch×input→new, dtype | upstream tok/s | fastgen tok/s | speedup "
        "| KV cache (fastgen/upstream) | identical | commit |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    footnotes = ["", *(f"({i}) {note}" for i, note in enumerate(notes, 1))] if notes else []
    return "\n".join([header, *[r for r in rows if r], *footnotes])


# The per-step breakdown tables of benchmarks/beam_steps.py (README, "Beam search per-step breakdown").
STEPS_BEGIN, STEPS_END = "<!-- beam-steps:begin -->", "<!-- beam-steps:end -->"
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


def _replace_block(text: str, begin: str, end: str, body: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def main() -> None:
    readme = ROOT / "README.md"
    text = _replace_block(readme.read_text(), BEGIN, END, table())
    if STEPS_BEGIN in text:
        text = _replace_block(text, STEPS_BEGIN, STEPS_END, beam_steps_tables())
    if CT2_BEGIN in text:  # issue 18: fastgen vs CTranslate2 (benchmarks/ctranslate2_compare.py)
        from benchmarks.ctranslate2_compare import readme_table

        text = _replace_block(text, CT2_BEGIN, CT2_END, readme_table())
    readme.write_text(text)


if __name__ == "__main__":
    main()
