"""Regenerates the README's results table from ``benchmarks/results/*.json``.

python -m benchmarks.report          # rewrite the table between the README markers
"""

from __future__ import annotations

import json
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


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + table() + "\n" + text[end:])


if __name__ == "__main__":
    main()
