#!/usr/bin/env bash
# What a GPU session runs (through the device tool, from the repo root): the GPU tests, the op
# micro-benchmarks and the generation benchmarks on CUDA, everything logged and written to $OUT.
#   bash scripts/gpu_check.sh                 # tests + op benchmarks + the default scenarios
#   bash scripts/gpu_check.sh bart-large gpt2 # tests + op benchmarks + these scenarios
# The GPU image has torch, triton and transformers but no fairseq (the fairseq scenario is skipped).
# fastgen's Transformers patches need transformers >= 5.18: if the image's is older, carry a wheel
# (see the device tool's README) and install it first, or the benchmarks honestly show ~1.0x.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fastgen-gpu}
mkdir -p "$OUT/results"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(bart-base bart-large gpt2 llama)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -m fastgen.info
} 2>&1 | tee "$OUT/info.txt"
# What comes back: info.txt, gpu.log and results.tar.gz (the device tool brings back at most 8 files).
{
  python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/cli tests  # tests/cli imports fairseq
  python3 -m benchmarks.ngram_op --device cuda --out "$OUT/results/ngram_op-cuda.json"
  python3 -m benchmarks.attention_op --device cuda --out "$OUT/results"
  python3 -m benchmarks.beam_topk_op --device cuda --out "$OUT/results/beam_topk_op-cuda.json"
  python3 -m tests.ops.ragged_attention_compile_check
  for s in "${scenarios[@]}"; do
    python3 -m benchmarks.run --scenario "$s" --device cuda --out "$OUT/results"
  done
} 2>&1 | tee "$OUT/gpu.log"
# The device tool brings back at most 8 files: pack every result JSON into one archive.
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
