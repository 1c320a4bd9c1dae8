"""Build a tiny random model + tokenizer and save them with ``save_pretrained`` (no download).

    python scripts/make_tiny_model.py OUT_DIR [--family bart|gpt2]   # also writes OUT_DIR/inputs.txt

The tokenizer is a word-level ``tokenizers`` model trained on a few sentences and wrapped in
``PreTrainedTokenizerFast``; the model is a 2-layer BART (encoder-decoder) or GPT-2 (decoder-only)
with random, deliberately wide weights so that different inputs give different outputs. It is
for trying the CLI and for tests: the text it writes is random words, not a translation.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "red",
    "green",
    "blue",
    "small",
    "large",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "river",
    "stone",
    "house",
    "city",
    "road",
    "runs",
    "sees",
    "finds",
    "makes",
    "takes",
    "gives",
    "near",
    "over",
    "under",
    "with",
    "from",
    "into",
    "quickly",
    "slowly",
    "today",
    "again",
]


def sentences(n: int, seed: int = 0, min_words: int = 2, max_words: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def build_model(family: str, vocab_size: int, seed: int = 0) -> transformers.PreTrainedModel:
    ids = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
    torch.manual_seed(seed)
    if family == "bart":
        config = transformers.BartConfig(
            vocab_size=vocab_size,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
            init_std=0.2,  # wide, untied: tiny default-init models repeat one token whatever the input
            tie_word_embeddings=False,
            dropout=0.0,
            attention_dropout=0.0,
            **ids,
        )
        model = transformers.BartForConditionalGeneration(config)
    elif family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=0.3,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(f"unknown family {family!r} (bart or gpt2)")
    model.generation_config.pad_token_id = 1
    return model.eval()


def make(out_dir: Path, family: str = "bart", seed: int = 0) -> Path:
    tokenizer = build_tokenizer()
    model = build_model(family, len(tokenizer), seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=["bart", "gpt2"], default="bart")
    parser.add_argument("--inputs", type=int, default=64, help="sentences to write to OUT_DIR/inputs.txt")
    args = parser.parse_args()
    make(args.out_dir, args.family)
    (args.out_dir / "inputs.txt").write_text("\n".join(sentences(args.inputs, seed=1)) + "\n")
    print(f"saved a tiny {args.family} model, its tokenizer and inputs.txt to {args.out_dir}")


if __name__ == "__main__":
    main()
