#!/usr/bin/env bash
# Builds the sdist and wheel (python -m build) and smoke-tests the wheel installed, not editable, into a
# fresh venv outside the checkout: import fastgen, python -m fastgen.info, one patched generate equal to
# upstream's, both CLIs' --help (fairseq is not a dependency of the wheel: without it fastgen-generate
# must say in one line what to install, exit status 2), and the CUDA sources for the JIT path shipped.
# The wheel is built without build isolation, so setup.py compiles the prebuilt CPU kernels (AVX-512 VNNI and
# AVX2) against .venv's torch; the first fast-mode call of the installed wheel then runs with no compiler on
# PATH (CXX=/nonexistent, an empty build cache), must use them, and its time is printed.
#   bash scripts/smoke_wheel.sh            # uses .venv's python to build (needs `build`, requirements-dev.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PY=${BUILD_PY:-.venv/bin/python}
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap '[ -n "${SMOKE_KEEP:-}" ] || rm -rf "$tmp"' EXIT  # SMOKE_KEEP=1 keeps it to look into
start=$(date +%s)
"$BUILD_PY" -m build --sdist --wheel --no-isolation --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; exit 1; }
echo "sdist + wheel built in $(($(date +%s) - start)) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
grep "prebuilt CPU kernels" "$tmp/build.log" || true
ls "$tmp"/dist
tar -tzf "$tmp"/dist/fastgen_seq-*.tar.gz >"$tmp/sdist.txt"
grep -q "csrc/bindings.cpp" "$tmp/sdist.txt"  # the sdist can rebuild the wheel
if grep -q "\.so$" "$tmp/sdist.txt"; then echo "binaries in the sdist"; exit 1; fi
"$BUILD_PY" -m zipfile -l "$tmp"/dist/fastgen_seq-*.whl | grep -o "fastgen/_cpu/fastgen_cpu_[a-z0-9]*\.so" |
  tee "$tmp/prebuilt.txt"
[ -s "$tmp/prebuilt.txt" ] || { echo "no prebuilt CPU kernels in the wheel"; exit 1; }
"$PY" -m venv "$tmp/venv"
VPY=$tmp/venv/bin/python
# torch first, the CPU build (a plain "torch" requirement may pull a multi-GB CUDA build), as scripts/setup.sh
"$VPY" -m pip install -q --no-compile "torch==${FASTGEN_TORCH_VERSION:-2.13.0}"
"$VPY" -m pip install -q --no-compile "$tmp"/dist/fastgen_seq-*.whl
cd "$tmp"  # away from the checkout: only the installed wheel can be imported
"$VPY" - <<'PY'
import pathlib

import fastgen
import fastgen.ops._ext as ext

where = pathlib.Path(fastgen.__file__).resolve()
assert "site-packages" in where.parts, f"fastgen imported from {where}, not from the installed wheel"
assert (ext._CSRC / "bindings.cpp").is_file() and list(ext._CSRC.glob("*.cu")), f"no CUDA sources in {ext._CSRC}"
assert (ext._CSRC / "cpu" / "attention.cpp").is_file(), f"no CPU kernel source in {ext._CSRC}"
print("fastgen", fastgen.__version__, "from", where.parent)
PY
"$VPY" -m fastgen.info >info.txt
head -3 info.txt
grep -q "applied" info.txt
"$VPY" - <<'PY'
import torch
from transformers import BartConfig, BartForConditionalGeneration

import fastgen

torch.manual_seed(0)
config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
model = BartForConditionalGeneration(config).eval()
inputs = {"input_ids": torch.randint(4, 64, (3, 10)), "attention_mask": torch.ones(3, 10, dtype=torch.long)}
kwargs = dict(num_beams=4, no_repeat_ngram_size=2, max_new_tokens=8)
with fastgen.report() as r:
    patched = model.generate(**inputs, **kwargs)
with fastgen.unpatched():
    upstream = model.generate(**inputs, **kwargs)
assert torch.equal(patched, upstream), "patched generate differs from upstream"
assert r.fast_path("dedup") and r.fast_path("ngram"), str(r)
print("patched generate == upstream; dedup and ngram ran")

PY
# The first fast-mode call of a fresh install, with no compiler on PATH and an empty build cache: the wheel's
# prebuilt kernels for this CPU must load (no build can), and quickly.
mkdir -p "$tmp/empty-path" "$tmp/home"
env -i HOME="$tmp/home" PATH="$tmp/empty-path" CXX=/nonexistent FASTGEN_CACHE="$tmp/empty-cache" OMP_NUM_THREADS=1 \
  "$VPY" - <<'PY'
import time

start = time.monotonic()
import torch
from transformers import BartConfig, BartForConditionalGeneration

import fastgen
from fastgen.ops import cpu_kernels

torch.manual_seed(0)
config = BartConfig(vocab_size=64, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=64)
model = BartForConditionalGeneration(config).eval()
inputs = {"input_ids": torch.randint(4, 64, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
ready = time.monotonic()
with fastgen.mode("fast"), fastgen.report() as r:
    model.generate(**inputs, num_beams=4, max_new_tokens=8)
call = time.monotonic() - ready
assert r.fast_path("fast_gemm"), str(r)
assert cpu_kernels.loaded() and cpu_kernels._state["source"].startswith("prebuilt"), cpu_kernels.describe()
print(f"first fast-mode call without a compiler: {call:.2f} s (import + model {ready - start:.1f} s); "
      f"CPU kernels {cpu_kernels.describe()}")
PY
"$tmp/venv/bin/fastgen-generate-hf" --help >/dev/null
status=0
"$tmp/venv/bin/fastgen-generate" --help >out.txt 2>err.txt || status=$?
cat err.txt
[ "$status" -eq 2 ] && [ "$(wc -l <err.txt)" -eq 1 ] && grep -q "pip install" err.txt && [ ! -s out.txt ]
echo "wheel smoke test: ok"
