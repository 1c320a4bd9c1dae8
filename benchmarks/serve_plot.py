"""Latency against offered request rate, fastgen-serve vs the micro-batching baseline, one panel per model.

Reads the committed load-test results (``benchmarks/results/serve_load*.json``, written by
``benchmarks/serve_load.py``) and writes an SVG for the docs. The SVG is written by hand (no plotting
library is a dependency of the project) and is deterministic, so the committed figure can be checked
against the results it was drawn from (tests/test_serve_plot.py).

    python -m benchmarks.serve_plot            # writes docs/benchmarks/img/serve-latency.svg
"""

from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = [ROOT / "benchmarks/results/serve_load.json", ROOT / "benchmarks/results/serve_load-lean-step.json"]
OUT = ROOT / "docs/benchmarks/img/serve-latency.svg"

SERVERS = {"fastgen": ("fastgen-serve", "#3f6fb5"), "baseline": ("micro-batching baseline", "#e0803a")}
PERCENTILES = {"p95_s": ("p95", ""), "p50_s": ("p50", "5 4")}  # stroke-dasharray per percentile
PANEL_W, PANEL_H, MARGIN_L, MARGIN_B, TOP = 420, 300, 48, 40, 78


def load(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Per model: its params and, per server, the points by rate (a later file's rate replaces an earlier's)."""
    models: dict[str, dict[str, Any]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        for name, model in result["models"].items():
            entry = models.setdefault(name, {"params": model["params"], "servers": {s: {} for s in SERVERS}})
            for server in SERVERS:
                for point in model[server]:
                    entry["servers"][server][point["rate"]] = point
            entry["p95_target_s"] = result["settings"]["p95_target_s"]
    return models


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """0 and round steps (1, 2 or 5 times a power of ten) up to at least ``high``."""
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [step * i for i in range(math.ceil(high / step - 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:g}"


def panel(name: str, model: dict[str, Any], left: float) -> list[str]:
    """One model: p95 (solid) and p50 (dashed) latency of each server against the offered rate."""
    points = [p for server in model["servers"].values() for p in server.values()]
    xs = nice_ticks(max(p["rate"] for p in points))
    ys = nice_ticks(max(p["p95_s"] for p in points))
    x0, y0 = left + MARGIN_L, TOP + PANEL_H - MARGIN_B
    width, height = PANEL_W - MARGIN_L - 16, PANEL_H - MARGIN_B - 16

    def x(rate: float) -> float:
        return x0 + width * rate / xs[-1]

    def y(seconds: float) -> float:
        return y0 - height * seconds / ys[-1]

    params = model["params"]
    search = f"beam {params['num_beams']}" if params.get("num_beams", 1) > 1 else "greedy"
    out = [
        f'<text x="{x0}" y="{TOP - 6}" font-weight="bold">'
        f"{html.escape(name)}: {search}, {params['max_new_tokens']} new tokens</text>"
    ]
    for tick in xs:
        out.append(f'<line x1="{x(tick):.1f}" y1="{y0}" x2="{x(tick):.1f}" y2="{y0 - height}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x(tick):.1f}" y="{y0 + 15}" text-anchor="middle">{_label(tick)}</text>')
    for tick in ys:
        out.append(f'<line x1="{x0}" y1="{y(tick):.1f}" x2="{x0 + width}" y2="{y(tick):.1f}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x0 - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{_label(tick)}</text>')
    out.append(f'<polyline points="{x0},{y0 - height} {x0},{y0} {x0 + width},{y0}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{x0 + width / 2:.1f}" y="{y0 + 32}" text-anchor="middle">offered rate (requests/s)</text>')
    out.append(
        f'<text transform="translate({left + 12},{y0 - height / 2:.1f}) rotate(-90)" text-anchor="middle">'
        "latency (s)</text>"
    )
    target = model["p95_target_s"]
    out.append(
        f'<line x1="{x0}" y1="{y(target):.1f}" x2="{x0 + width}" y2="{y(target):.1f}" stroke="#999" '
        'stroke-dasharray="2 3"/>'
    )
    out.append(f'<text x="{x0 + width - 2}" y="{y(target) - 4:.1f}" text-anchor="end" fill="#777">{target:g} s</text>')
    for server, (_, color) in SERVERS.items():
        series = [model["servers"][server][rate] for rate in sorted(model["servers"][server])]
        for key, (_, dashes) in PERCENTILES.items():
            line = " ".join(f"{x(p['rate']):.1f},{y(p[key]):.1f}" for p in series)
            dash = f' stroke-dasharray="{dashes}"' if dashes else ""
            out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
            out.extend(f'<circle cx="{x(p["rate"]):.1f}" cy="{y(p[key]):.1f}" r="2.5" fill="{color}"/>' for p in series)
    return out


def legend() -> list[str]:
    out, left = [], 0
    for label, color in SERVERS.values():
        for name, dashes in PERCENTILES.values():
            dash = f' stroke-dasharray="{dashes}"' if dashes else ""
            out.append(f'<line x1="{left}" y1="38" x2="{left + 26}" y2="38" stroke="{color}" stroke-width="2"{dash}/>')
            text = f"{label} {name}"
            out.append(f'<text x="{left + 32}" y="42">{html.escape(text)}</text>')
            left += 48 + 7 * len(text)
    return out


def figure(models: dict[str, dict[str, Any]]) -> str:
    """The SVG: a title, the legend, and one panel per model side by side."""
    width = PANEL_W * len(models)
    title = "Latency against offered load: fastgen-serve vs a micro-batching server (1 torch thread each)"
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {TOP + PANEL_H}" role="img" '
        f'aria-label="{html.escape(title)}" style="font-family:sans-serif;font-size:12px">',
        f'<rect width="{width}" height="{TOP + PANEL_H}" fill="white"/>',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{html.escape(title)}</text>',
        *legend(),
    ]
    for index, (name, model) in enumerate(models.items()):
        body.extend(panel(name, model, index * PANEL_W))
    body.append("</svg>")
    return "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", type=Path, default=RESULTS, help="serve_load result files")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(figure(load(args.results)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
