"""A tiny saved BART and an input file of random sentences, shared by the CLI tests' fixtures."""

from pathlib import Path

from scripts import make_tiny_model


def bart_and_inputs(root: Path, sentences: int, max_words: int, seed: int = 5) -> dict[str, Path]:
    inputs = root / "inputs.txt"
    inputs.write_text("\n".join(make_tiny_model.sentences(sentences, seed=seed, max_words=max_words)) + "\n")
    return {"bart": make_tiny_model.make(root / "bart", "bart"), "inputs": inputs}
