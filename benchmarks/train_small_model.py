"""Train a small BART on real English that ships with Python: the model the CPU modes' quality is measured on.

    OMP_NUM_THREADS=1 python -m benchmarks.train_small_model [--out ~/.cache/fastgen/trained-bart]
        [--steps 1000] [--batch-size 16] [--d-model 256] [--layers 3] [--heads 4] [--ffn 1024] [--vocab 4000]
        [--corpus topics+docstrings|topics] [--threads 1] [--seed 0]

Random weights make every logit margin alike, so agreement measured on them says little about a model
whose predictions are confident in some places and unsure in others. This script trains one in minutes:
the default 1000 updates cost about 0.2 s of CPU each here (AMD EPYC, AVX-512, 1 thread), under 4 CPU
minutes in all; with the machine's 2 cores at a load of 6-13 the run took 14 minutes of wall time.

Corpus: the English text of Python's own ``help()`` topics (``pydoc_data/topics.py``) and the docstrings
of the standard library (both under the PSF license, installed with every Python), cut into sentences of
6 to 30 words. Documents (a help topic, a stdlib file) are split between training and test by a hash of
their name, so the test sentences come from documents never trained on; a test sentence that also occurs
in training is dropped. The corpus therefore depends on the Python version; its hash is recorded.

Task: BART-style denoising. About 20% of a sentence's words, in spans of 1 to 3 words, have every token
replaced by ``<mask>``; the model restores the sentence, so it copies most tokens and guesses the rest.
The source keeps the target's length (one ``<mask>`` per token, not per span as in BART's text infilling)
so that the copy alignment is learned within the minutes this script has; the weights start at
``init_std`` 0.05 rather than BART's 0.02, with which cross-attention stayed flat (no copying, loss ~4.7)
for over 800 updates here. Masks are drawn afresh for every training example and once (seeded) for the
test set.

Writes to ``--out``: ``hf/`` (``save_pretrained`` model and its byte-level BPE tokenizer), ``ct2/`` (the
CTranslate2 conversion of ``benchmarks.ctranslate2_compare.convert``, loadable as float32 and
int8_float32), ``test.jsonl`` (source with masks, reference sentence) and ``training.json`` (settings,
loss curve, corpus facts and the held-out cross-entropy, predictive entropy, beam-4 BLEU and chrF).
Deterministic for a given seed, thread count and Python/torch version.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

import fastgen
from benchmarks.measure import environment, result_header, write_result

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0-4, BART's order
BOS, PAD, EOS, MASK_ID = 0, 1, 2, 4
MAX_TOKENS = 64  # longest target (BPE tokens + </s>) kept; the generation length cap is above it
GENERATE: dict[str, Any] = dict(max_new_tokens=96, length_penalty=1.0, no_repeat_ngram_size=0, early_stopping=False)
DEFAULT_OUT = Path.home() / ".cache" / "fastgen" / "trained-bart"
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "site-packages", "__pycache__"}


def documents(docstrings: bool = True) -> list[tuple[str, str]]:
    """(name, text) of every help topic and (``docstrings``) of every stdlib file's docstrings, in a fixed order."""
    import pydoc_data.topics

    docs = [(f"topic:{key}", pydoc_data.topics.topics[key]) for key in sorted(pydoc_data.topics.topics)]
    if not docstrings:
        return docs
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIP_DIRS.intersection(relative.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        texts = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        docs.append((f"stdlib:{relative}", "\n\n".join(t for t in texts if t)))
    return docs


def sentences(text: str) -> list[str]:
    """Prose sentences of 6-30 words: paragraphs joined into lines, cut after . ! ? before a capital."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        line = " ".join(part.strip() for part in paragraph.split("\n"))
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", line):
            sentence = sentence.strip()
            words = sentence.split()
            if (
                6 <= len(words) <= 30
                and sentence[-1] in ".!?"
                and sum(c.isalpha() for c in sentence) > 0.7 * len(sentence)
                and not re.search(r">>>|\*\*\*|===|---|\.\.\.", sentence)
            ):
                found.append(sentence)
    return found


def split_corpus(test_share: float = 0.05, docstrings: bool = True) -> tuple[list[str], list[str], str]:
    """Training and test sentences (documents split by name hash, duplicates removed) and the corpus hash."""
    train: dict[str, None] = {}
    test: dict[str, None] = {}
    digest = hashlib.sha256()
    for name, text in documents(docstrings):
        digest.update(name.encode() + text.encode())
        bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10_000
        target = test if bucket < test_share * 10_000 else train
        target.update(dict.fromkeys(sentences(text)))
    return list(train), [s for s in test if s not in train], digest.hexdigest()[:16]


def train_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (no unknown tokens; decoding gives the text back) with BART's special tokens first."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def mask_words(word_ids: list[int], rng: random.Random, ratio: float = 0.2, longest_span: int = 3) -> list[bool]:
    """Which tokens to mask: spans of 1..longest_span words (``word_ids``: each token's word), about
    ``ratio`` of the words, spans kept apart."""
    words = max(word_ids) + 1
    budget = max(1, round(ratio * words))
    masked = [False] * words
    while budget > 0:
        span = min(rng.randint(1, longest_span), budget)
        start = rng.randrange(words - span + 1)
        budget -= span
        if not any(masked[max(0, start - 1) : start + span + 1]):
            masked[start : start + span] = [True] * span
    return [masked[w] for w in word_ids]


def noised_source(tokenizer: Any, sentence: str, rng: random.Random) -> list[int]:
    """<s> sentence </s> with every token of the masked words replaced by <mask>: the source keeps the
    target's length and positions, so copying is learned in minutes and the model's work is the infilling."""
    encoding = tokenizer.encode(sentence)
    hidden = mask_words(encoding.word_ids, rng)
    return [BOS, *(MASK_ID if h else t for t, h in zip(encoding.ids, hidden, strict=True)), EOS]


def encode_target(tokenizer: Any, text: str) -> list[int]:
    return [*tokenizer.encode(text).ids, EOS]


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Text of generated ids: up to the first </s>, special tokens left out."""
    if EOS in ids:
        ids = ids[: ids.index(EOS)]
    return tokenizer.decode([i for i in ids if i >= len(SPECIAL)]).strip()


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def source_batch(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    ids = pad(rows, PAD)
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}


def build_model(
    vocab_size: int,
    d_model: int,
    layers: int,
    heads: int,
    ffn: int,
    dropout: float = 0.0,
    init_std: float = 0.02,
) -> Any:
    config = transformers.BartConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=128,
        dropout=dropout,
        init_std=init_std,
        attention_dropout=0.0,
        activation_dropout=0.0,
        bos_token_id=BOS,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        forced_eos_token_id=None,  # CTranslate2 has no forced end: keep the two decoders' rules alike
    )
    model = transformers.BartForConditionalGeneration(config)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=EOS
    )
    return model


def batches(
    train: list[tuple[str, list[int]]], tokenizer: Any, batch_size: int, rng: random.Random
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of freshly masked sentences; sentences of like length share a batch (less padding)."""
    while True:
        order = list(range(len(train)))
        rng.shuffle(order)
        chunk = 50 * batch_size
        groups = []
        for c in range(0, len(order), chunk):
            by_length = sorted(order[c : c + chunk], key=lambda i: len(train[i][1]))
            groups += [by_length[b : b + batch_size] for b in range(0, len(by_length), batch_size)]
        rng.shuffle(groups)
        for group in groups:
            sources = [noised_source(tokenizer, train[i][0], rng) for i in group]
            labels = pad([train[i][1] for i in group], -100)
            yield {**source_batch(sources), "labels": labels}


def held_out_scores(model: Any, test: list[dict[str, Any]], batch_size: int = 32) -> dict[str, Any]:
    """Teacher-forced on the references: per-token cross-entropy, entropy of the predictive distribution
    and argmax accuracy (nats; a uniform guess has entropy ln V, a model that only copies has ~0), over all
    target tokens and apart for the masked ones (guessed) and the others (copied, and the final </s>)."""
    sums = {group: torch.zeros(4, dtype=torch.float64) for group in ("masked", "copied")}
    with torch.inference_mode():
        for b in range(0, len(test), batch_size):
            rows = test[b : b + batch_size]
            labels = pad([r["target_ids"] for r in rows], -100)
            logits = model(**source_batch([r["source_ids"] for r in rows]), labels=labels).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
            target = labels.clamp(min=0)
            per_token = torch.stack(
                [
                    -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1),
                    -(logp.exp() * logp).sum(-1),
                    (logp.argmax(-1) == target).float(),
                    torch.ones_like(target, dtype=torch.float32),
                ]
            ).double()
            masked = pad([r["source_ids"][1:] for r in rows], PAD) == MASK_ID  # source token i + 1 <-> target i
            sums["masked"] += per_token[:, masked].sum(-1)
            sums["copied"] += per_token[:, (labels != -100) & ~masked].sum(-1)

    def scores(loss: float, entropy: float, correct: float, count: float) -> dict[str, float]:
        return {
            "cross_entropy_nats_per_token": loss / count,
            "predictive_entropy_nats_per_token": entropy / count,
            "argmax_accuracy": correct / count,
            "target_tokens": int(count),
        }

    every = scores(*(sums["masked"] + sums["copied"]).tolist())
    return {
        **every,
        "perplexity": math.exp(every["cross_entropy_nats_per_token"]),
        "uniform_entropy_nats": math.log(model.config.vocab_size),
        **{f"{group}_tokens": scores(*values.tolist()) for group, values in sums.items()},
    }


def generate_texts(model: Any, tokenizer: Any, test: list[dict[str, Any]], num_beams: int, batch_size: int = 16):
    texts = []
    with torch.inference_mode():
        for b in range(0, len(test), batch_size):
            rows = test[b : b + batch_size]
            out = model.generate(**source_batch([r["source_ids"] for r in rows]), num_beams=num_beams, **GENERATE)
            texts += [decode(tokenizer, row[1:]) for row in out.tolist()]
    return texts


def quality(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    import sacrebleu

    return {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
    }


def load_test(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init-std", type=float, default=0.05, help="BART's 0.02 leaves attention flat for long")
    parser.add_argument("--dropout", type=float, default=0.0, help="0: a few minutes of training underfits anyway")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--test-size", type=int, default=300)
    parser.add_argument("--train-size", type=int, default=0, help="use only the first N training sentences (0: all)")
    parser.add_argument("--test-share", type=float, default=0.05, help="share of documents held out")
    parser.add_argument("--corpus", choices=["topics+docstrings", "topics"], default="topics+docstrings")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()

    train_text, test_text, corpus_hash = split_corpus(args.test_share, args.corpus == "topics+docstrings")
    tokenizer = train_tokenizer(train_text, args.vocab)
    train = [(s, ids) for s in train_text if len(ids := encode_target(tokenizer, s)) <= MAX_TOKENS]
    if args.train_size:
        train = train[: args.train_size]
    test_rng = random.Random(args.seed + 1)
    test_text = [s for s in test_text if len(encode_target(tokenizer, s)) <= MAX_TOKENS]
    test_text = sorted(test_rng.sample(test_text, min(args.test_size, len(test_text))), key=len)
    test = []
    for sentence in test_text:
        source_ids = noised_source(tokenizer, sentence, test_rng)
        test.append(
            {
                "source": tokenizer.decode(source_ids[1:-1], skip_special_tokens=False).strip(),
                "target": sentence,
                "source_ids": source_ids,
                "target_ids": encode_target(tokenizer, sentence),
            }
        )
    vocab_size = tokenizer.get_vocab_size()
    model = build_model(vocab_size, args.d_model, args.layers, args.heads, args.ffn, args.dropout, args.init_std)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, min(100, args.steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.05, (args.steps - s) / max(1, args.steps - warmup)))
    )
    curve, window = [], []
    stream = batches(train, tokenizer, args.batch_size, rng)
    train_start, train_start_cpu = time.perf_counter(), time.process_time()
    model.train()
    with fastgen.unpatched():  # training is upstream code; fastgen only changes generation
        for step in range(1, args.steps + 1):
            loss = model(**next(stream)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            window.append(loss.item())
            if step % 50 == 0 or step == args.steps:
                curve.append({"step": step, "train_loss": sum(window) / len(window), "seconds": _since(train_start)})
                window = []
                sys.stdout.write(f"step {step}: loss {curve[-1]['train_loss']:.3f} ({curve[-1]['seconds']:.0f} s)\n")
                sys.stdout.flush()
        train_seconds, train_cpu_seconds = _since(train_start), round(time.process_time() - train_start_cpu, 2)
        model.eval()
        scores = held_out_scores(model, test)
        hypotheses = generate_texts(model, tokenizer, test, num_beams=4)
    references = [r["target"] for r in test]
    masked_only = [decode(tokenizer, r["source_ids"][1:]) for r in test]
    scores |= {f"beam4_{k}": v for k, v in quality(hypotheses, references).items()}
    scores |= {f"source_without_masks_{k}": v for k, v in quality(masked_only, references).items()}

    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("hf", "ct2"):
        shutil.rmtree(args.out / stale, ignore_errors=True)
    _save(model, tokenizer, args.out)
    (args.out / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    report = {
        **result_header("train_small_model", argv),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "corpus": {
            "source": f"{args.corpus}: pydoc_data/topics.py, standard-library docstrings (PSF license)",
            "python": sys.version.split()[0],
            "sha256_16": corpus_hash,
            "train_sentences": len(train),
            "test_sentences": len(test),
            "vocab_size": vocab_size,
        },
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,  # on a busy machine the wall time mostly measures the others
        "total_seconds": _since(started),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "loss_curve": curve,
        "held_out": scores,
        "examples": [
            {"source": r["source"], "hypothesis": h, "reference": r["target"]}
            for r, h in list(zip(test, hypotheses, strict=True))[:: max(1, len(test) // 5)]
        ],
        "environment": environment("cpu"),
    }
    write_result(args.out / "training.json", report)
    sys.stdout.write(json.dumps({"held_out": scores, "train_seconds": train_seconds}, indent=2) + "\n")
    return report


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    """``save_pretrained`` of model and tokenizer into out/hf; out/ct2 by ctranslate2_compare.convert."""
    from benchmarks.ctranslate2_compare import convert

    try:
        convert(model, out)  # writes out/hf with model.save_pretrained, then out/ct2
    except ImportError:
        model.save_pretrained(out / "hf")
        sys.stdout.write("ctranslate2 is not installed: no CTranslate2 conversion\n")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>",
    )  # fmt: skip
    fast.save_pretrained(out / "hf")


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 2)


if __name__ == "__main__":
    main()
