"""``python -m fastgen.info`` reports versions, the extension, backends and the patch table."""

import subprocess
import sys

import torch


def test_info_reports_every_section():
    out = subprocess.run([sys.executable, "-m", "fastgen.info"], capture_output=True, text=True, check=True).stdout
    assert f"torch {torch.__version__}" in out
    assert "transformers fast paths (tested up to" in out and ": ok" in out
    assert "compiled extension:" in out and "ngram: " in out and "torch: ok" in out
    from fastgen.ops import int8_linear

    assert "CPU instruction sets: " in out and f"  int8: {int8_linear.backend()}" in out
    assert "  CPU kernels (attention, int8 passes, top-k): " in out
    # Transformers' targets are imported first, so their patches are resolved, not pending.
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("transformers.")]
    hf_rows = [row for i in starts for row in lines[i + 1 :] if row.startswith("  ")][: len(starts)]
    assert starts and hf_rows and all(row.split()[1] in {"applied", "skipped"} for row in hf_rows)
    assert (
        max(len(line) for line in lines[lines.index(next(x for x in lines if x.startswith("fastgen patches"))) :]) <= 80
    )
