"""Train a small BART on real English that ships with the installed packages: the model the CPU modes'
quality is measured on.

    OMP_NUM_THREADS=1 python -m benchmarks.train_small_model [--out ~/.cache/fastgen/trained-bart-restore]
        [--minutes 35 | --steps N] [--batch-size 32] [--d-model 256] [--encoder-layers 4] [--decoder-layers 3]
        [--heads 4] [--ffn 1024] [--vocab 6000] [--corpus topics+packages|topics] [--test-size 1200] [--seed 0]

Random weights make every logit margin alike, so agreement measured on them says little about a model
whose predictions are confident in some places and unsure in others. This script trains one that has
learned a task a copy cannot solve, within a wall-time budget on one CPU thread.

Corpus: the English text of Python's ``help()`` topics (``pydoc_data/topics.py``), the docstrings of the
standard library and of every package installed beside this one (``site-packages``: torch, transformers,
scipy, sympy, ...; tests and Transformers' per-model files, largely copies of each other, left out), cut
into sentences of 6 to 30 words. Documents (a help topic, a file) are split between training and test by a
hash of their name, so the test sentences come from files never trained on; a test sentence that also
occurs in training is dropped. The corpus therefore depends on what is installed; its hash is recorded.

Task: restore a sentence from a degraded copy. The source is the sentence lowercased, without its commas,
with about 15% of its words hidden in spans of 1 or 2 words, each span one ``<mask>`` token (the source
does not say how many words a mask hides). The model must restore case (sentence starts, names, class
names), put the commas back and guess the hidden words: real uncertainty that copying cannot remove. The
copy baseline (the source with its masks dropped) is scored beside the model. Masks are drawn afresh for
every training example and once (seeded) for the test set.

Writes to ``--out``: ``hf/`` (``save_pretrained`` model and its byte-level BPE tokenizer), ``ct2/`` (the
CTranslate2 conversion of ``benchmarks.ctranslate2_compare.convert``, loadable as float32 and
int8_float32), ``test.jsonl`` (source, copy baseline, reference) and ``training.json`` (settings, loss
curve, corpus facts and the held-out cross-entropy, predictive entropy, beam-4 and greedy BLEU and chrF
beside the copy baseline's). With ``--minutes`` the learning rate decays with the elapsed share of the
budget, so the run is not bit-reproducible; ``--steps`` is deterministic for a given seed, thread count
and package set.
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
MASK_RATIO, LONGEST_SPAN = 0.15, 2
GENERATE: dict[str, Any] = dict(max_new_tokens=96, length_penalty=1.0, no_repeat_ngram_size=0, early_stopping=False)
DEFAULT_OUT = Path.home() / ".cache" / "fastgen" / "trained-bart-restore"
_SKIP_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "encodings", "__pycache__"}


def _docstrings(root: Path, prefix: str, skip: set[str]) -> Iterator[tuple[str, str]]:
    """(name, docstrings) of every ``.py`` file under ``root`` outside the ``skip`` directories."""
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skip.intersection(relative.parts) or relative.parts[:2] == ("transformers", "models"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            if '"""' not in text and "'''" not in text:
                continue
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        texts = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        yield f"{prefix}:{relative}", "\n\n".join(t for t in texts if t)


def documents(packages: bool = True) -> list[tuple[str, str]]:
    """(name, text) of every help topic and (``packages``) of the docstrings of every file of the standard
    library and of ``site-packages``, in a fixed order."""
    import pydoc_data.topics

    docs = [(f"topic:{key}", pydoc_data.topics.topics[key]) for key in sorted(pydoc_data.topics.topics)]
    if not packages:
        return docs
    paths = sysconfig.get_paths()
    docs += _docstrings(Path(paths["stdlib"]), "stdlib", _SKIP_DIRS | {"site-packages"})
    docs += _docstrings(Path(paths["purelib"]), "site", _SKIP_DIRS)
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


def split_corpus(test_share: float = 0.05, packages: bool = True) -> tuple[list[str], list[str], str]:
    """Training and test sentences (documents split by name hash, duplicates removed) and the corpus hash."""
    train: dict[str, None] = {}
    test: dict[str, None] = {}
    digest = hashlib.sha256()
    for name, text in documents(packages):
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


def mask_words(
    words: int, rng: random.Random, ratio: float = MASK_RATIO, longest_span: int = LONGEST_SPAN
) -> list[int]:
    """Start of each hidden span and its length (1..longest_span words), about ``ratio`` of ``words`` words,
    spans kept apart; as a list ``span[w]``: the span length starting at word w, 0 elsewhere, -1 inside."""
    budget = max(1, round(ratio * words))
    span_at = [0] * words
    for _ in range(4 * budget):
        if budget <= 0:
            break
        span = min(rng.randint(1, longest_span), budget, words)
        start = rng.randrange(words - span + 1)
        if not any(span_at[max(0, start - 1) : start + span + 1]):
            span_at[start : start + span] = [span] + [-1] * (span - 1)
            budget -= span
    return span_at


def degrade(sentence: str, rng: random.Random) -> tuple[list[str | None], str]:
    """The source's pieces (lowercased words without commas; None for a hidden span) and the copy baseline
    (those words with the masks dropped)."""
    words = sentence.split()
    pieces: list[str | None] = []
    for word, span in zip(words, mask_words(len(words), rng), strict=True):
        if span > 0:
            pieces.append(None)
        elif span == 0:
            pieces.append(word.lower().replace(",", ""))
    pieces = [p for p in pieces if p != ""]  # a lone comma
    return pieces, " ".join(p for p in pieces if p is not None)


def noised_source(tokenizer: Any, sentence: str, rng: random.Random) -> list[int]:
    """<s> degraded sentence </s>: the runs of words between masks encoded as text, one <mask> per span."""
    pieces, _ = degrade(sentence, rng)
    ids, run = [BOS], []
    for piece in [*pieces, None]:
        if piece is not None:
            run.append(piece)
            continue
        if run:
            ids += tokenizer.encode(" ".join(run)).ids
            run = []
        ids.append(MASK_ID)
    ids[-1] = EOS  # the sentinel's mask
    return ids


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
    layers: tuple[int, int],
    heads: int,
    ffn: int,
    dropout: float = 0.0,
    init_std: float = 0.02,
) -> Any:
    """A BART of ``layers`` = (encoder, decoder) layers."""
    config = transformers.BartConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers[0],
        decoder_layers=layers[1],
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
    and argmax accuracy (nats; a uniform guess has entropy ln V, a model sure of every token ~0)."""
    sums = torch.zeros(4, dtype=torch.float64)
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
            sums += per_token[:, labels != -100].sum(-1)
    loss, entropy, correct, count = sums.tolist()
    return {
        "cross_entropy_nats_per_token": loss / count,
        "perplexity": math.exp(loss / count),
        "predictive_entropy_nats_per_token": entropy / count,
        "argmax_accuracy": correct / count,
        "target_tokens": int(count),
        "uniform_entropy_nats": math.log(model.config.vocab_size),
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


def make_test(tokenizer: Any, sentences: list[str], rng: random.Random) -> list[dict[str, Any]]:
    """The test rows: degraded source (ids and text), the copy baseline and the reference."""
    test = []
    for sentence in sentences:
        state = rng.getstate()
        source_ids = noised_source(tokenizer, sentence, rng)
        rng.setstate(state)
        _, copy = degrade(sentence, rng)  # the same draws: the copy baseline of this very source
        test.append(
            {
                "source": tokenizer.decode(source_ids[1:-1], skip_special_tokens=False).strip(),
                "copy": copy,
                "target": sentence,
                "source_ids": source_ids,
                "target_ids": encode_target(tokenizer, sentence),
            }
        )
    return test


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1000, help="updates (ignored with --minutes)")
    parser.add_argument("--minutes", type=float, default=0.0, help="train for this much wall time instead")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init-std", type=float, default=0.05, help="BART's 0.02 leaves attention flat for long")
    parser.add_argument("--dropout", type=float, default=0.0, help="0: less than an epoch is seen anyway")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--encoder-layers", type=int, default=4)
    parser.add_argument("--decoder-layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=6000)
    parser.add_argument("--test-size", type=int, default=1200)
    parser.add_argument("--train-size", type=int, default=0, help="use only the first N training sentences (0: all)")
    parser.add_argument("--test-share", type=float, default=0.05, help="share of documents held out")
    parser.add_argument("--corpus", choices=["topics+packages", "topics"], default="topics+packages")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()

    train_text, test_text, corpus_hash = split_corpus(args.test_share, args.corpus == "topics+packages")
    tokenizer = train_tokenizer(train_text, args.vocab)
    train = [(s, ids) for s in train_text if len(ids := encode_target(tokenizer, s)) <= MAX_TOKENS]
    if args.train_size:
        train = train[: args.train_size]
    test_rng = random.Random(args.seed + 1)
    test_text = [s for s in test_text if len(encode_target(tokenizer, s)) <= MAX_TOKENS]
    held_out_available = len(test_text)
    test_text = sorted(test_rng.sample(test_text, min(args.test_size, len(test_text))), key=len)
    test = make_test(tokenizer, test_text, test_rng)
    vocab_size = tokenizer.get_vocab_size()
    layers = (args.encoder_layers, args.decoder_layers)
    model = build_model(vocab_size, args.d_model, layers, args.heads, args.ffn, args.dropout, args.init_std)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    budget = args.minutes * 60
    steps = 10**9 if budget else args.steps
    warmup = 100 if budget else max(1, min(100, args.steps // 10))
    curve, window = [], []
    stream = batches(train, tokenizer, args.batch_size, rng)
    train_start, train_start_cpu = time.perf_counter(), time.process_time()
    model.train()
    step = 0
    with fastgen.unpatched():  # training is upstream code; fastgen only changes generation
        while step < steps:
            step += 1
            done = (time.perf_counter() - train_start) / budget if budget else (step - warmup) / max(1, steps - warmup)
            if budget and done >= 1:
                break
            for group in optimizer.param_groups:  # linear warm-up, then linear decay to 5% of the peak
                group["lr"] = args.lr * min(step / warmup, max(0.05, 1 - done))
            loss = model(**next(stream)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            window.append(loss.item())
            if step % 100 == 0 or step == steps:
                curve.append({"step": step, "train_loss": sum(window) / len(window), "seconds": _since(train_start)})
                window = []
                sys.stdout.write(f"step {step}: loss {curve[-1]['train_loss']:.3f} ({curve[-1]['seconds']:.0f} s)\n")
                sys.stdout.flush()
        updates = step if not budget else step - 1
        train_seconds, train_cpu_seconds = _since(train_start), round(time.process_time() - train_start_cpu, 2)
        model.eval()
        scores = held_out_scores(model, test)
        hypotheses = {beams: generate_texts(model, tokenizer, test, num_beams=beams) for beams in (4, 1)}
    references = [r["target"] for r in test]
    scores |= {f"beam4_{k}": v for k, v in quality(hypotheses[4], references).items()}
    scores |= {f"greedy_{k}": v for k, v in quality(hypotheses[1], references).items()}
    scores |= {f"copy_baseline_{k}": v for k, v in quality([r["copy"] for r in test], references).items()}

    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("hf", "ct2"):
        shutil.rmtree(args.out / stale, ignore_errors=True)
    _save(model, tokenizer, args.out)
    (args.out / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    report = {
        **result_header("train_small_model", argv),
        "task": "restore case, commas and masked 1-2-word spans (one <mask> per span) of a lowercased sentence",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "corpus": {
            "source": f"{args.corpus}: pydoc_data/topics.py, docstrings of the standard library and site-packages",
            "python": sys.version.split()[0],
            "sha256_16": corpus_hash,
            "train_sentences": len(train),
            "held_out_sentences_available": held_out_available,
            "test_sentences": len(test),
            "vocab_size": vocab_size,
        },
        "parameters": sum(p.numel() for p in model.parameters()),
        "updates": updates,
        "sentences_seen": updates * args.batch_size,
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,  # on a busy machine the wall time mostly measures the others
        "total_seconds": _since(started),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "loss_curve": curve,
        "held_out": scores,
        "examples": [
            {"source": r["source"], "copy_baseline": r["copy"], "hypothesis": h, "reference": r["target"]}
            for r, h in list(zip(test, hypotheses[4], strict=True))[:: max(1, len(test) // 6)]
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
