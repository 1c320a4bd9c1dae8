"""Train a real draft/target pair for the speculative-decoding benchmark, on CPU, in a few minutes.

    .venv/bin/python -m benchmarks.spec_pair        # cached: a second run only prints the facts

Corpus: the running Python's standard library sources (``Lib/**/*.py`` without tests: code and
docstrings), which every machine with Python has. Files whose name hashes into the last 1/20 are
held out; the benchmark takes its prompts from them.

Tokenizer: a code-word vocabulary built from the training files (no download): a newline with its
indentation, a run of spaces, an identifier/number, or one punctuation character is a token; the
``VOCAB - 4`` most frequent are kept, others map to ``<unk>`` (0 pad, 1 bos, 2 eos, 3 unk). Words
learn much faster than bytes, which matters for a few minutes of training on a loaded CPU.

Models: GPT-2 configs. The target (6 layers, d=128) is trained on the token stream; the draft
(1 layer, d=128) starts from the target's token/position embeddings, final norm and head (a fresh
block) and is distilled from it (KL to the target's next-token distribution), as drafts usually
are; ``--independent-draft`` also trains a draft of the same shape from scratch on the corpus.
Each run is a fixed number of steps capped by seconds, with a cosine learning rate over the
budget that runs out first. Saved with ``save_pretrained`` under ``~/.cache/fastgen/spec-pair``
(``FASTGEN_SPEC_PAIR`` overrides) with the vocabulary and ``facts.json``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import re
import sysconfig
import time
from pathlib import Path

import torch
import transformers

PAD, BOS, EOS, UNK, SPECIAL = 0, 1, 2, 3, 4
VOCAB = 2048
CACHE = Path(os.environ.get("FASTGEN_SPEC_PAIR", Path.home() / ".cache" / "fastgen" / "spec-pair"))
TOKEN = re.compile(r"\n[ ]*|[ ]+|\w+|[^\w\s]|\s")

#: name -> (GPT2Config kwargs, max training steps, max seconds)
MODELS = {
    "target": (dict(n_layer=6, n_embd=128, n_head=4), 3000, 330),
    "draft": (dict(n_layer=1, n_embd=128, n_head=4), 3000, 120),
}
SEQ_LEN, BATCH = 128, 16


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def held_out(path: Path) -> bool:
    return int(hashlib.sha1(path.name.encode()).hexdigest(), 16) % 20 == 0


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


class Vocabulary:
    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.ids = {w: i + SPECIAL for i, w in enumerate(words)}

    @classmethod
    def build(cls, texts: list[str]) -> Vocabulary:
        counts = collections.Counter(t for text in texts for t in TOKEN.findall(text))
        return cls([w for w, _ in counts.most_common(VOCAB - SPECIAL)])

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(t, UNK) for t in TOKEN.findall(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words[i - SPECIAL] if i >= SPECIAL else ("<unk>" if i == UNK else "") for i in ids)


def config(**kwargs: int) -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=512,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **kwargs,
    )


def _draft_from(teacher: transformers.GPT2LMHeadModel, kwargs: dict) -> transformers.GPT2LMHeadModel:
    """A one-layer student with the teacher's embeddings, final norm and head, and a fresh block."""
    student = transformers.GPT2LMHeadModel(config(**kwargs))
    shared = ("transformer.wte.", "transformer.wpe.", "transformer.ln_f.", "lm_head.")
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if k.startswith(shared)}, strict=False)
    return student


def train(
    name: str, data: torch.Tensor, seed: int = 0, teacher: transformers.GPT2LMHeadModel | None = None, save_as: str = ""
) -> dict:
    """Train ``name`` on the token stream; with a ``teacher``, distil it (KL to its next-token distribution)."""
    kwargs, max_steps, max_seconds = MODELS[name]
    save_as = save_as or name
    torch.manual_seed(seed)
    model = _draft_from(teacher, kwargs) if teacher is not None else transformers.GPT2LMHeadModel(config(**kwargs))
    peak_lr, warmup = 3e-3, 30
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    start, losses, step = time.perf_counter(), [], 0
    model.train()
    while step < max_steps and (elapsed := time.perf_counter() - start) < max_seconds:
        progress = max(step / max_steps, elapsed / max_seconds)
        for group in optimizer.param_groups:
            group["lr"] = peak_lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        offsets = torch.randint(0, len(data) - SEQ_LEN - 1, (BATCH,), generator=generator)
        batch = torch.stack([data[o : o + SEQ_LEN] for o in offsets.tolist()])
        if teacher is None:
            loss = model(input_ids=batch, labels=batch).loss
        else:
            with torch.no_grad():
                target_logp = teacher(input_ids=batch).logits.log_softmax(-1)
            logp = model(input_ids=batch).logits.log_softmax(-1)
            loss = torch.nn.functional.kl_div(logp, target_logp, log_target=True, reduction="none").sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"{name}: step {step} loss {sum(losses[-50:]) / 50:.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    model.generation_config.pad_token_id = PAD
    model.save_pretrained(CACHE / save_as)
    facts = {
        "config": kwargs,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": step,
        "tokens_seen": step * BATCH * SEQ_LEN,
        "seconds": round(time.perf_counter() - start, 1),
        ("final_kl_to_target_nats" if teacher else "final_loss_nats_per_token"): round(
            sum(losses[-50:]) / len(losses[-50:]), 4
        ),
        "init": "target's embeddings, final norm and head + fresh block; distilled from the target"
        if teacher
        else "random",
    }
    (CACHE / save_as / "train_facts.json").write_text(json.dumps(facts, indent=2))
    return facts


def vocabulary() -> Vocabulary:
    return Vocabulary(json.loads((CACHE / "vocab.json").read_text()))


def load(draft_kind: str = "distilled") -> tuple[transformers.GPT2LMHeadModel, transformers.GPT2LMHeadModel, dict]:
    """The cached pair (target, draft) and its facts; trains what is missing first.

    ``draft_kind``: ``"distilled"`` (the default draft) or ``"independent"`` (same shape, random
    init, trained on the corpus itself: a pair that agrees less, like drafts not made for their target).
    """
    if not (CACHE / "facts.json").exists():
        main([])
    name = "draft" if draft_kind == "distilled" else "draft-independent"
    if not (CACHE / name).exists():
        main(["--independent-draft"])
    facts = json.loads((CACHE / "facts.json").read_text())
    facts["draft"] = json.loads((CACHE / name / "train_facts.json").read_text())
    target = transformers.GPT2LMHeadModel.from_pretrained(CACHE / "target").eval()
    draft = transformers.GPT2LMHeadModel.from_pretrained(CACHE / name).eval()
    return target, draft, facts


def prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Token prompts cut from held-out stdlib files (never trained on), lengths in [min_len, max_len]."""
    vocab = vocabulary()
    generator = torch.Generator().manual_seed(seed)
    texts = [vocab.encode(_read(p)) for p in stdlib_files() if held_out(p)]
    texts = [t for t in texts if len(t) > max_len + 1]
    out = []
    for i in range(count):
        text = texts[i % len(texts)]
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        start = int(torch.randint(0, len(text) - length, (1,), generator=generator))
        out.append(text[start : start + length])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="retrain even when cached")
    parser.add_argument("--draft-only", action="store_true", help="keep the cached target, retrain the draft")
    parser.add_argument(
        "--independent-draft", action="store_true", help="train the draft-independent model (random init, no teacher)"
    )
    args = parser.parse_args(argv)
    if (CACHE / "facts.json").exists() and not (args.force or args.draft_only or args.independent_draft):
        print((CACHE / "facts.json").read_text())
        return 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    files = stdlib_files()
    train_texts = [_read(p) for p in files if not held_out(p)]
    CACHE.mkdir(parents=True, exist_ok=True)
    if not args.draft_only:
        (CACHE / "vocab.json").write_text(json.dumps(Vocabulary.build(train_texts).words))
    vocab = vocabulary()
    ids = [i for text in train_texts for i in [*vocab.encode(text), EOS]]
    data = torch.tensor(ids)
    if args.independent_draft:
        print("draft-independent", train("draft", data, seed=1, save_as="draft-independent"))
        return 0
    facts = {
        "corpus": f"Python {sysconfig.get_python_version()} standard library sources (Lib/**/*.py without "
        "tests, idlelib, lib2to3); held out: files whose name hashes to 0 mod 20",
        "tokenizer": f"code words (newline+indent, spaces, identifier/number, punctuation), top {VOCAB - SPECIAL}"
        " of the training files + pad/bos/eos/unk",
        "train_files": len(train_texts),
        "held_out_files": sum(held_out(p) for p in files),
        "train_tokens": len(data),
        "unk_rate": round(float((data == UNK).float().mean()), 4),
        "seq_len": SEQ_LEN,
        "batch": BATCH,
        "vocab_size": VOCAB,
    }
    if args.draft_only:
        facts["target"] = json.loads((CACHE / "target" / "train_facts.json").read_text())
    else:
        facts["target"] = train("target", data)
    print("target", facts["target"])
    teacher = transformers.GPT2LMHeadModel.from_pretrained(CACHE / "target").eval()
    facts["draft"] = train("draft", data, teacher=teacher)
    print("draft", facts["draft"])
    (CACHE / "facts.json").write_text(json.dumps(facts, indent=2))
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
