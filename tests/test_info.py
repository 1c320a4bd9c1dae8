"""``python -m fastgen.info`` reports versions, the extension, backends and the patch table."""

import os
import subprocess
import sys

import torch


def test_info_reports_every_section(tmp_path):
    # An empty build cache and no prebuilt kernels: info must say so, not build them (a minute) to find out;
    # and with the attention kernel switched off it must not call it built or in use.
    env = {**os.environ, "FASTGEN_CACHE": str(tmp_path / "cache"), "FASTGEN_CPU_PREBUILT": "0"}
    env.update(FASTGEN_CPU_ATTENTION="0", FASTGEN_CPU_KERNELS="1", CXX="c++")
    run = subprocess.run([sys.executable, "-m", "fastgen.info"], capture_output=True, text=True, check=True, env=env)
    out = run.stdout
    assert f"torch {torch.__version__}" in out
    assert "transformers fast paths (tested up to" in out and ": ok" in out
    assert "compiled extension:" in out and "ngram: " in out and "torch: ok" in out
    from fastgen.ops import int8_linear

    assert "CPU instruction sets: " in out and f"  int8: {int8_linear.backend()}" in out
    kernels = next(line for line in out.splitlines() if line.startswith("  CPU kernels (csrc/cpu): "))
    assert "not built yet: the first fast-mode call builds them (~" in kernels or "unavailable: " in kernels, kernels
    assert "built and loaded" not in out and "  attention kernel (fast modes): off (FASTGEN_CPU_ATTENTION=0)" in out
    assert not (tmp_path / "cache").exists() and "building" not in run.stderr
    # Transformers' targets are imported first, so their patches are resolved, not pending.
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("transformers.")]
    hf_rows = [row for i in starts for row in lines[i + 1 :] if row.startswith("  ")][: len(starts)]
    assert starts and hf_rows and all(row.split()[1] in {"applied", "skipped"} for row in hf_rows)
    assert (
        max(len(line) for line in lines[lines.index(next(x for x in lines if x.startswith("fastgen patches"))) :]) <= 80
    )
