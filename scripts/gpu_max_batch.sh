#!/usr/bin/env bash
# The second GPU run (issue 12): the largest bart-large batch that fits a memory budget, upstream vs
# fastgen, and samples/s at each (benchmarks/max_batch.py), fp16 and fp32; results packed into one archive.
#   bash scripts/gpu_max_batch.sh            # 16 GiB budget (a few minutes on an H100)
#   bash scripts/gpu_max_batch.sh 40         # another budget, in GiB
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fastgen-gpu}
mkdir -p "$OUT/max_batch"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
budget=${1:-16}
{
  for dtype in fp16 fp32; do
    python3 -m benchmarks.max_batch --scenario bart-large --budget-gib "$budget" --dtype "$dtype" \
      --granularity 16 --out "$OUT/max_batch/max_batch-bart-large-$dtype-cuda.json"
  done
} 2>&1 | tee "$OUT/max_batch.log"
tar -czf "$OUT/max_batch.tar.gz" -C "$OUT" max_batch && rm -rf "$OUT/max_batch"
