"""benchmarks/train_small_model.py and benchmarks/trained_agreement.py end to end, at a tiny size.

The real run trains for minutes; here a few steps of a d=32 model are enough to check that the corpus,
the tokenizer, the saved model, the test set and the CTranslate2 conversion fit together, and that
fastgen's exact mode decodes the saved model exactly as upstream does.
"""

import json
import random

import pytest

from benchmarks import train_small_model as trained
from benchmarks import trained_agreement


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained-bart")
    argv = ["--out", str(out), "--steps", "20", "--d-model", "32", "--ffn", "64", "--layers", "2", "--heads", "2"]
    trained.main([*argv, "--vocab", "600", "--test-size", "24", "--batch-size", "16"])
    return out


def test_training_saves_model_tokenizer_test_set_and_conversion(model_dir):
    report = json.loads((model_dir / "training.json").read_text())
    assert (model_dir / "hf" / "config.json").exists() and (model_dir / "hf" / "tokenizer.json").exists()
    if pytest.importorskip("ctranslate2"):
        assert (model_dir / "ct2" / "model.bin").exists()
    test = trained.load_test(model_dir)
    assert len(test) == report["corpus"]["test_sentences"] == 24
    assert all(trained.MASK in row["source"] and trained.MASK not in row["target"] for row in test)
    held_out = report["held_out"]
    assert 0 < held_out["predictive_entropy_nats_per_token"] <= held_out["uniform_entropy_nats"] + 1e-6
    assert {"beam4_bleu", "beam4_chrf", "cross_entropy_nats_per_token"} <= held_out.keys()


def test_test_sentences_are_not_training_sentences():
    train, test, _ = trained.split_corpus()
    assert len(train) > 5000 and len(test) > 300
    assert not set(train) & set(test)


def test_masking_replaces_each_span_by_one_mask():
    sentence = "the quick brown fox jumps over the lazy dog near the river bank today"
    for seed in range(20):
        noised = trained.mask_words(sentence, random.Random(seed))
        kept = [w for w in noised.split() if w != trained.MASK]
        assert trained.MASK in noised and f"{trained.MASK} {trained.MASK}" not in noised
        words = iter(sentence.split())
        assert all(w in words for w in kept)  # the kept words, in order


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
