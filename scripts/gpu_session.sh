#!/usr/bin/env bash
# One GPU lease, two calls (issue 26): each part runs its steps in priority order under one deadline,
# every step capped, so a hang or a failure costs only its own share. Run through the device tool:
#   carry .whl (transformers wheel + its missing needs) and .specpair (benchmarks.spec_pair's cached pair)
#   bash scripts/gpu_session.sh 1 420   # part 1: tests, bart-large fp16, profile, continuous, speculative, n-gram op
#   bash scripts/gpu_session.sh 2 260   # part 2: max batch, bart-large fp32, op benchmarks, more scenarios
#   bash scripts/gpu_session.sh 3 255   # part 3: fixes from parts 1-2 checked, warm vs cold continuous batching
#   bash scripts/gpu_session.sh 4 390   # part 4: the CUDA-graph decode step (tests, fp32, bart-large fp16, max batch)
#   bash scripts/gpu_session.sh 8 480   # part 8: decoder-only graphs (gpt2, llama), cold start without cuDNN, fairseq
#   bash scripts/gpu_session.sh 9 330   # part 9: part 8's findings (no cuDNN in captures, stacked reorder), host profile
#   bash scripts/gpu_session.sh 10 200  # part 10: part 9's finding (the reorder copied the whole prompt each step)
#   bash scripts/gpu_session.sh 11 420  # part 11: fp16 rows against upstream's own batch halves; max batch again
#   bash scripts/gpu_session.sh 12 320  # part 12: fastgen-generate-hf over a 256-line file at the bart-large shape
#   (.whl for part 8 also carries ve-fairseq 0.12.3 and its missing needs: hydra-core, omegaconf, antlr4, bitarray)
# What comes back: $OUT/part<N>.log and $OUT/results-part<N>.tar.gz (JSON results).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-1}
deadline=$((SECONDS + ${2:-420}))
OUT=${OUT:-/tmp/fastgen-gpu}
results=$OUT/results
mkdir -p "$results"
log=$OUT/part$part.log
exec > >(tee "$log") 2>&1

if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
[ -d .specpair ] && export FASTGEN_SPEC_PAIR=$PWD/.specpair
unset TRITON_INTERPRET

# step CAP_SECONDS NAME COMMAND...: runs COMMAND under min(CAP, time left), logs its status and time
step() {
  local cap=$1 name=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "=== $name: SKIPPED (deadline)"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "=== $name (cap ${cap}s) $(date +%T)"
  local start=$SECONDS
  timeout -k 5 "$cap" "$@"
  echo "=== $name: rc $? in $((SECONDS - start))s"
}

if [ "$part" = 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, transformers.__file__, 'triton', triton.__version__)"
  step 60 info python3 -m fastgen.info
  step 170 gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 90 -rfE \
    tests/test_gpu_generation.py tests/ops/test_ngram.py tests/ops/test_beam_topk.py tests/ops/test_attention_triton.py \
    tests/ops/test_ragged_attention.py tests/optimizer/test_ngram_patches.py  # (tests/cli needs fairseq, absent there)
  step 100 bart-large-fp16 python3 -m benchmarks.run --scenario bart-large --device cuda --dtype fp16 --rounds 2 --out "$results"
  step 70 profile-bart-large-fp16 python3 -m benchmarks.step_profile --scenario bart-large --device cuda --dtype fp16 \
    --new-tokens 32 --repeats 2 --out "$results"
  step 120 continuous-fp16 python3 -m benchmarks.continuous_batching --device cuda --dtype fp16 --shape bart-base \
    --inputs 256 --min-input 16 --max-input 512 --beams 4 --batch-size 32 --max-new-tokens 128 --no-repeat-ngram-size 3 \
    --output "$results/continuous_batching-bart-base-b4-bs32-cuda-fp16.json"
  step 60 speculative python3 -m benchmarks.speculative --device cuda --batches 1 8 --rounds 2 --out "$results"
  step 30 ngram-op python3 -m benchmarks.ngram_op --device cuda --threads 1 --slow-repeats 2 --out "$results/ngram_op-cuda.json"
elif [ "$part" = 4 ]; then  # the CUDA-graph decode step: its tests, fp32 tokens, bart-large against eager/upstream
  export FASTGEN_JIT=0
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  step 110 graph-tests python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE -x -m gpu \
    tests/models/test_graph_step.py tests/test_gpu_generation.py
  step 70 graph-fp32 python3 -m benchmarks.graph_step --scenario bart-large --dtype fp32 --batch 8 --input-len 256 \
    --new-tokens 32 --rounds 1 --out "$results"
  step 170 graph-bart-large-fp16 python3 -m benchmarks.graph_step --scenario bart-large --dtype fp16 --rounds 2 \
    --out "$results"
  step 110 graph-max-batch python3 -m benchmarks.max_batch --scenario bart-large --budget-gib 8 --dtype fp16 \
    --granularity 16 --rounds 1 --out "$results/max_batch-bart-large-fp16-8gib-graphs-cuda.json"
  step 50 graph-profile python3 -m benchmarks.step_profile --scenario bart-large --device cuda \
    --dtype fp16 --new-tokens 32 --repeats 1 --out "$results"
elif [ "$part" = 8 ]; then  # decoder-only static step under graphs; cold start without cuDNN attention; fairseq
  export FASTGEN_JIT=0
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  step 90 graph-tests python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE -m gpu \
    tests/models/test_decoder_graph_step.py tests/models/test_graph_step.py
  step 100 gpt2-fp16 python3 -m benchmarks.graph_step --scenario gpt2 --dtype fp16 --rounds 2 --out "$results"
  step 110 llama-fp16 python3 -m benchmarks.graph_step --scenario llama --dtype fp16 --rounds 2 --out "$results"
  step 110 bart-large-no-cudnn python3 -m benchmarks.graph_step --scenario bart-large --dtype fp16 --rounds 2 \
    --no-cudnn-attention --out "$results"
  step 45 gpt2-fp32 python3 -m benchmarks.graph_step --scenario gpt2 --dtype fp32 --batch 4 --input-len 128 \
    --new-tokens 32 --rounds 1 --out "$results"
  step 60 fairseq-fp16 python3 -m benchmarks.run --scenario fairseq-transformer --device cuda --dtype fp16 \
    --rounds 2 --out "$results"
elif [ "$part" = 9 ]; then  # after part 8: captures without cuDNN attention, the stacked reorder; where gpt2's host time goes
  export FASTGEN_JIT=0
  step 60 graph-tests python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE -m gpu \
    tests/models/test_decoder_graph_step.py tests/models/test_graph_step.py
  step 80 gpt2-fp16 python3 -m benchmarks.graph_step --scenario gpt2 --dtype fp16 --rounds 2 --out "$results"
  step 50 gpt2-host-profile python3 -m benchmarks.host_profile --scenario gpt2 --dtype fp16 --top 45 --out "$results"
  step 100 bart-large-fp16 python3 -m benchmarks.graph_step --scenario bart-large --dtype fp16 --rounds 2 \
    --out "$results"
  step 50 gpt2-step-profile python3 -m benchmarks.step_profile --scenario gpt2 --device cuda --dtype fp16 \
    --new-tokens 32 --repeats 1 --out "$results"
elif [ "$part" = 10 ]; then  # after part 9: the decoder-only beam reorder moves only the generated positions
  export FASTGEN_JIT=0
  step 60 graph-tests python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE -m gpu \
    tests/models/test_decoder_graph_step.py
  step 70 gpt2-fp16 python3 -m benchmarks.graph_step --scenario gpt2 --dtype fp16 --rounds 2 --out "$results"
  step 50 llama-fp16 python3 -m benchmarks.graph_step --scenario llama --dtype fp16 --rounds 2 --out "$results"
  step 30 gpt2-fp32 python3 -m benchmarks.graph_step --scenario gpt2 --dtype fp32 --batch 4 --input-len 128 \
    --new-tokens 32 --rounds 1 --out "$results"
elif [ "$part" = 11 ]; then  # next: fp16 rows against upstream's own spread, the largest batch after part 9's change
  export FASTGEN_JIT=0
  step 60 graph-tests python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE -m gpu \
    tests/models/test_decoder_graph_step.py tests/models/test_graph_step.py
  for scenario in gpt2 llama; do
    step 80 "$scenario-fp16-halves" python3 -m benchmarks.graph_step --scenario "$scenario" --dtype fp16 --rounds 2 \
      --upstream-halves --out "$results"
  done
  step 120 bart-large-fp16-halves python3 -m benchmarks.graph_step --scenario bart-large --dtype fp16 --rounds 2 \
    --upstream-halves --out "$results"
  step 110 max-batch python3 -m benchmarks.max_batch --scenario bart-large --budget-gib 8 --dtype fp16 \
    --granularity 16 --rounds 1 --out "$results/max_batch-bart-large-fp16-8gib-graphs-cuda.json"
elif [ "$part" = 12 ]; then  # next: end to end over a file, as FastSeq measured (model load, tokenizer and writing included)
  export FASTGEN_JIT=0
  step 300 cli-e2e python3 -m benchmarks.cli_gpu --device cuda --dtype float16 --lines 256 --rounds 1 --out "$results"
elif [ "$part" = 3 ]; then  # after the first two: fixes checked, warm vs cold, the common call's memory
  export FASTGEN_JIT=0  # no extension build (40 s of a short lease): n-gram blocking runs its Triton kernel
  step 45 gpu-generation-tests python3 -m pytest -q -p no:cacheprovider --timeout 40 -rfE tests/test_gpu_generation.py
  step 50 speculative python3 -m benchmarks.speculative --device cuda --batches 1 8 --rounds 2 --out "$results"
  step 80 continuous-fp16-2rounds python3 -m benchmarks.continuous_batching --device cuda --dtype fp16 \
    --shape bart-base --inputs 128 --min-input 16 --max-input 512 --beams 4 --batch-size 32 --max-new-tokens 128 \
    --no-repeat-ngram-size 3 --rounds 2 --output "$results/continuous_batching-bart-base-b4-bs32-128in-2rounds-cuda-fp16.json"
  step 75 max-batch-fp16-sequences python3 -m benchmarks.max_batch --scenario bart-large --budget-gib 8 --dtype fp16 \
    --granularity 16 --rounds 1 --sequences-only --out "$results/max_batch-bart-large-fp16-8gib-sequences-cuda.json"
else
  step 130 max-batch-fp16 python3 -m benchmarks.max_batch --scenario bart-large --budget-gib 8 --dtype fp16 \
    --granularity 16 --rounds 1 --out "$results/max_batch-bart-large-fp16-8gib-cuda.json"
  step 80 bart-large-fp32 python3 -m benchmarks.run --scenario bart-large --device cuda --dtype fp32 --rounds 1 \
    --batch 16 --out "$results"
  step 20 beam-topk-op python3 -m benchmarks.beam_topk_op --device cuda --out "$results/beam_topk_op-cuda.json"
  step 20 attention-op python3 -m benchmarks.attention_op --device cuda --out "$results"
  step 20 ragged-compile python3 -m tests.ops.ragged_attention_compile_check
  step 60 gpt2-fp16 python3 -m benchmarks.run --scenario gpt2 --device cuda --dtype fp16 --rounds 2 --out "$results"
fi
tar -czf "$OUT/results-part$part.tar.gz" -C "$OUT" results && rm -rf "$results"
echo "=== part $part done in ${SECONDS}s"
