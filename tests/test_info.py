"""``python -m fastgen.info`` reports versions, the extension, backends and the patch table."""

import subprocess
import sys

import torch


def test_info_reports_every_section():
    out = subprocess.run([sys.executable, "-m", "fastgen.info"], capture_output=True, text=True, check=True).stdout
    assert f"torch {torch.__version__}" in out
    assert "compiled extension:" in out and "ngram: " in out and "torch: ok" in out
    # Transformers' targets are imported first, so their patches are resolved, not pending.
    hf_rows = [line for line in out.splitlines() if line.split()[1:2] and line.split()[1].startswith("transformers.")]
    assert hf_rows and all(not line.split(maxsplit=2)[2].startswith("pending") for line in hf_rows)
