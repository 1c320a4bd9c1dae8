"""What exact half precision costs decoder-only prompt sharing on CPU (the torch path).

In bf16/fp16 on the torch path, fastgen's shared-prompt attention now attends with upstream's own
function over the per-hypothesis K/V (``fastgen.models.decoder_only._half_precision_exact``) instead
of its split products, for upstream's tokens. This times, alternating in one process after a warm-up,
upstream, fastgen as shipped, and fastgen with the split products forced (the previous behaviour).

    OMP_NUM_THREADS=1 python -m benchmarks.half_precision_cost
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import transformers

import fastgen
import fastgen.models.decoder_only as decoder_only
from benchmarks.measure import environment

RESULTS = Path(__file__).parent / "results" / "half_precision_cost-cpu.json"
CONFIG = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
              pad_token_id=1, bos_token_id=0, eos_token_id=2)  # fmt: skip
BATCH, PROMPT, NEW, BEAMS, ROUNDS = 2, 256, 32, 4, 5


def main() -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval().to(torch.bfloat16)
    ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, PROMPT))
    kwargs = dict(num_beams=BEAMS, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)

    def upstream():
        with fastgen.unpatched():
            return model.generate(input_ids=ids, **kwargs)

    def shipped():
        return model.generate(input_ids=ids, **kwargs)

    def split_products():
        with mock.patch.object(decoder_only, "_half_precision_exact", lambda *a: False):
            return model.generate(input_ids=ids, **kwargs)

    runs = {"upstream": upstream, "fastgen (exact half precision)": shipped, "fastgen (split products)": split_products}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up
    for _ in range(ROUNDS):
        for name, fn in runs.items():
            start = time.perf_counter()
            with torch.no_grad():
                fn()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.half_precision_cost",
        "environment": environment("cpu"),
        "shape": {**CONFIG, "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "beams": BEAMS, "dtype": "bfloat16"},
        "rounds": ROUNDS,
        "seconds": seconds,
        "median_seconds": medians,
        "speedup_vs_upstream": {name: medians["upstream"] / m for name, m in medians.items()},
        "tokens_equal_upstream": {name: bool(torch.equal(out, outputs["upstream"])) for name, out in outputs.items()},
    }
    print(json.dumps({k: result[k] for k in ("median_seconds", "speedup_vs_upstream", "tokens_equal_upstream")}))
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
