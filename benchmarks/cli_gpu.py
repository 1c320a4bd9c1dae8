"""End to end as FastSeq measured it: ``fastgen-generate-hf`` over a text file against upstream's own loop.

    python -m benchmarks.cli_gpu --device cuda --dtype float16 --lines 256          # bart-large shape
    python -m benchmarks.cli_gpu --device cpu --shape tiny --lines 8                # the harness, on a CPU

A random model of the chosen shape (bart-large: 12+12 layers, d 1,024, vocabulary 50,265) is saved with a
word-level tokenizer of the same vocabulary (made, not downloaded), and a file of ``--lines`` lines of
``--words`` random words is written. Variants, each a whole run from the file to the written output
(model loading, tokenization and detokenization included), alternating for ``--rounds`` after one warm-up
round: upstream's loop (tokenize a batch, ``generate`` under ``fastgen.unpatched()``, ``batch_decode``,
write) and ``fastgen-generate-hf`` with its default batching and with ``--no-continuous-batching``. Reported:
medians, samples/s, the ratio to upstream's loop, the time to load the model alone (in every variant's
figure), and how many output lines equal upstream's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import fastgen
from benchmarks.measure import environment, load_average, result_header, write_result
from benchmarks.scenarios import SCENARIOS

RESULTS = Path(__file__).parent / "results"
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
#: a shape small enough for a CPU smoke run
TINY = dict(
    vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
)  # fmt: skip


def make_model_dir(root: Path, shape: str, dtype: torch.dtype) -> Path:
    """A random BART of ``shape`` and a word-level tokenizer over its whole vocabulary, saved in ``root``."""
    config = dict(SCENARIOS["bart-large"].config) if shape == "bart-large" else dict(TINY)
    config |= dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIALS), config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(**config)).to(dtype).eval()
    model.save_pretrained(root)
    wrapped.save_pretrained(root)
    return root


def write_lines(path: Path, lines: int, words: int, vocab: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = (" ".join(f"w{rng.randrange(len(SPECIALS), vocab)}" for _ in range(rng.randrange(words // 2, words + 1)))
            for _ in range(lines))  # fmt: skip
    path.write_text("".join(row + "\n" for row in rows))


def variants(model_dir: Path, inputs: Path, args: argparse.Namespace) -> dict[str, Any]:
    from fastgen.cli.generate_hf import load_model, load_tokenizer
    from fastgen.cli.generate_hf import main as hf_main

    kwargs = dict(num_beams=4, no_repeat_ngram_size=3, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)

    def upstream(out: Path) -> None:
        tokenizer = load_tokenizer(model_dir, False)
        model = load_model(model_dir, args.device, args.dtype)
        lines = inputs.read_text().splitlines()
        with fastgen.unpatched(), open(out, "w") as handle:
            for start in range(0, len(lines), args.batch_size):
                batch = tokenizer(lines[start : start + args.batch_size], return_tensors="pt", padding=True)
                ids = model.generate(**batch.to(args.device), **kwargs)
                handle.writelines(t + "\n" for t in tokenizer.batch_decode(ids, skip_special_tokens=True))

    cli = [str(model_dir), "--input", str(inputs), "--batch-size", str(args.batch_size), "--num-beams", "4"]
    cli += ["--no-repeat-ngram-size", "3", "--max-new-tokens", str(args.new_tokens)]
    cli += ["--gen", f"min_new_tokens={args.new_tokens}", "--device", args.device, "--dtype", args.dtype]
    cli += ["--no-progress-bar"]
    return {
        "upstream loop (generate + batch_decode)": upstream,
        "fastgen-generate-hf": lambda out: hf_main([*cli, "--output", str(out)]),
        "fastgen-generate-hf --no-continuous-batching": lambda out: hf_main(
            [*cli, "--output", str(out), "--no-continuous-batching"]
        ),
    }


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("bart-large", "tiny"), default="bart-large")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--words", type=int, default=1000, help="words per line: between half this and this")
    parser.add_argument("--new-tokens", type=int, default=140)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = result_header("cli_gpu", argv) | {"environment": environment(args.device.split(":")[0])}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_model_dir(root / "model", args.shape, getattr(torch, args.dtype))
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        inputs = root / "inputs.txt"
        write_lines(inputs, args.lines, args.words, vocab)
        from fastgen.cli.generate_hf import load_model

        started = time.perf_counter()
        del_model = load_model(model_dir, args.device, args.dtype)
        synchronize(args.device)
        load_s = time.perf_counter() - started
        del del_model
        runs = variants(model_dir, inputs, args)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        texts: dict[str, list[str]] = {}
        before = load_average()
        for round_ in range(args.rounds + 1):  # round 0 warms every variant at the shape
            for number, (name, run) in enumerate(runs.items()):
                out = root / f"out-{number}-{round_}.txt"
                synchronize(args.device)
                started = time.perf_counter()
                run(out)
                synchronize(args.device)
                elapsed = time.perf_counter() - started
                if round_:
                    seconds[name].append(elapsed)
                else:
                    result.setdefault("cold_s", {})[name] = elapsed
                texts[name] = out.read_text().splitlines()
                print(f"round {round_} {name}: {elapsed:.2f} s", flush=True)
    base_name = next(iter(runs))
    base = statistics.median(seconds[base_name])
    result["settings"] = vars(args) | {"out": str(args.out), "model_load_s": load_s}
    result["variants"] = {
        name: {
            "seconds": values,
            "median_s": statistics.median(values),
            "samples_per_s": args.lines / statistics.median(values),
            "speedup_vs_upstream_loop": base / statistics.median(values),
            "lines_equal_to_upstream": f"{sum(a == b for a, b in zip(texts[base_name], texts[name], strict=False))}"
            f"/{len(texts[base_name])}",
        }
        for name, values in seconds.items()
    }
    result["load_average"] = {"start": before, "end": load_average()}
    for name, row in result["variants"].items():
        print(f"{name:48s} {row['median_s']:.2f} s  {row['samples_per_s']:.1f} samples/s  "
              f"{row['speedup_vs_upstream_loop']:.2f}x  lines equal {row['lines_equal_to_upstream']}")  # fmt: skip
    print(f"model load alone: {load_s:.2f} s (inside every figure)")
    device = args.device.split(":")[0]
    write_result(args.out / f"cli_gpu-{args.shape}-{device}-{args.dtype}.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
