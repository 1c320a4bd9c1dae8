"""benchmarks/train_small_model.py and benchmarks/trained_agreement.py end to end, at a tiny size.

The real run trains for minutes; here five steps of a d=32 model are enough to check that the corpus,
the tokenizer, the saved model, the test set and the CTranslate2 conversion fit together, and that
fastgen's exact mode decodes the saved model exactly as upstream does.
"""

import importlib.util
import json
import random

import pytest

from benchmarks import train_small_model as trained
from benchmarks import trained_agreement


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained-bart")
    # Barely trained at BART's init_std, the logit margins are tiny: any change in the arithmetic flips tokens
    # (int8 in place of the exact mode: 11 of 24 beam-4 rows differ), so "identical" below means something.
    argv = ["--out", str(out), "--steps", "5", "--init-std", "0.02", "--d-model", "32", "--ffn", "64"]
    argv += ["--layers", "2", "--heads", "2"]
    # Only the help topics (parsing every stdlib file takes seconds): 20% of them held out.
    trained.main([*argv, "--vocab", "600", "--corpus", "topics", "--test-share", "0.2", "--test-size", "24"])
    return out


def test_training_saves_model_tokenizer_test_set_and_conversion(model_dir):
    report = json.loads((model_dir / "training.json").read_text())
    assert (model_dir / "hf" / "config.json").exists() and (model_dir / "hf" / "tokenizer.json").exists()
    if importlib.util.find_spec("ctranslate2") is not None:  # an optional benchmark dependency
        assert (model_dir / "ct2" / "model.bin").exists()
    test = trained.load_test(model_dir)
    assert len(test) == report["corpus"]["test_sentences"] == 24
    for row in test:  # the masked source keeps the target's tokens and positions except where masked
        source, target = row["source_ids"][1:], row["target_ids"]
        assert len(source) == len(target) and trained.MASK_ID in source and trained.MASK_ID not in target
        assert all(s in (t, trained.MASK_ID) for s, t in zip(source, target, strict=True))
    held_out = report["held_out"]
    assert 0 < held_out["predictive_entropy_nats_per_token"] <= held_out["uniform_entropy_nats"] + 1e-6
    assert {"beam4_bleu", "beam4_chrf", "cross_entropy_nats_per_token", "masked_tokens"} <= held_out.keys()
    parts = held_out["masked_tokens"]["target_tokens"] + held_out["copied_tokens"]["target_tokens"]
    assert parts == held_out["target_tokens"] == sum(len(row["target_ids"]) for row in test)


def test_test_sentences_are_not_training_sentences():
    train, test, _ = trained.split_corpus(0.2, docstrings=False)
    assert len(train) > 1000 and len(test) > 100
    assert not set(train) & set(test)


def test_masking_hides_whole_words_in_separate_spans():
    word_ids = [0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 11, 12, 13, 14]
    for seed in range(50):
        hidden = trained.mask_words(word_ids, random.Random(seed))
        words = {w: h for w, h in zip(word_ids, hidden, strict=True)}
        assert all(words[w] == h for w, h in zip(word_ids, hidden, strict=True))  # all of a word or none
        assert 1 <= sum(words.values()) <= 3  # about 20% of 15 words
        spans = "".join("x" if words[w] else "." for w in range(15)).split(".")
        assert all(len(span) <= 3 for span in spans)


def test_agreement_script_exact_mode_equals_upstream(model_dir, tmp_path):
    out = tmp_path / "agreement.json"
    report = trained_agreement.main(["--model-dir", str(model_dir), "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text())["modes"].keys() == {"beam4", "greedy"}
    assert report["environment"]["cpu_kind"] in {"amx", "avx512", "avx2", "cpu"}
    for mode in report["modes"].values():
        candidates = mode["candidates"]
        assert {"upstream", "fastgen_exact", "fastgen_fast"} <= candidates.keys()
        assert candidates["fastgen_exact"]["vs_upstream"] == {"sequence_match": 1.0, "token_agreement": 1.0}
        assert all({"bleu", "chrf", "median_wall_seconds", "vs_upstream"} <= c.keys() for c in candidates.values())
        assert ("fastgen_int8" in candidates) == report["int8_feature"]


def test_divergences_are_located_against_the_masks():
    m = trained.MASK_ID
    test = [{"source_ids": [0, 7, m, 9, 2]}, {"source_ids": [0, 7, m, 9, 2]}, {"source_ids": [0, 7, 8, 9, 2]}]
    reference = [[7, 8, 9], [7, 8, 9], [7, 8, 9]]
    other = [[7, 5, 9], [7, 8, 6], [7, 8, 9]]  # first differs on the mask, second after it, third equal
    assert trained_agreement.divergences_on_masks(reference, other, test) == "1/2"
    assert trained_agreement.agreement(reference, other) == {"sequence_match": 1 / 3, "token_agreement": 7 / 9}
