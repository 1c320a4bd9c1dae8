"""benchmarks/train_small_model.py and benchmarks/trained_agreement.py end to end, at a tiny size.

The real run trains for minutes; here five steps of a d=32 model are enough to check that the corpus,
the tokenizer, the saved model, the test set and the CTranslate2 conversion fit together, and that
fastgen's exact mode decodes the saved model exactly as upstream does.
"""

import importlib.util
import json
import random

import pytest
import tokenizers
import torch

from benchmarks import train_small_model as trained
from benchmarks import trained_agreement


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained-bart")
    # Barely trained at BART's init_std, the logit margins are tiny: any change in the arithmetic flips tokens
    # (int8 in place of the exact mode: 11 of 24 beam-4 rows differ), so "identical" below means something.
    argv = ["--out", str(out), "--steps", "5", "--init-std", "0.02", "--d-model", "32", "--ffn", "64"]
    argv += ["--encoder-layers", "2", "--decoder-layers", "1", "--heads", "2", "--batch-size", "16"]
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
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "hf" / "tokenizer.json"))
    for row in test:  # the source: lowercased, no commas, one <mask> per hidden span; the copy drops the masks
        source = row["source_ids"]
        assert source[0] == trained.BOS and source[-1] == trained.EOS and trained.MASK_ID in source
        text = tokenizer.decode(source, skip_special_tokens=False)
        assert text == text.lower() and "," not in text
        assert trained.MASK_ID not in row["target_ids"] and row["copy"] == " ".join(row["copy"].split())
        assert trained.decode(tokenizer, [t for t in source[1:] if t != trained.MASK_ID]) == row["copy"]
        assert set(row["copy"].split()) <= set(row["target"].lower().replace(",", "").split())
    held_out = report["held_out"]
    assert 0 < held_out["predictive_entropy_nats_per_token"] <= held_out["uniform_entropy_nats"] + 1e-6
    assert {"beam4_bleu", "greedy_chrf", "copy_baseline_bleu", "cross_entropy_nats_per_token"} <= held_out.keys()
    assert held_out["target_tokens"] == sum(len(row["target_ids"]) for row in test)


def test_test_sentences_are_not_training_sentences():
    train, test, _ = trained.split_corpus(0.2, packages=False)
    assert len(train) > 1000 and len(test) > 100
    assert not set(train) & set(test)


def test_masking_hides_spans_of_one_or_two_words_apart():
    for seed in range(50):
        spans = trained.mask_words(20, random.Random(seed))
        hidden = [s != 0 for s in spans]
        assert 1 <= sum(hidden) <= 3  # about 15% of 20 words
        for w, span in enumerate(spans):
            if span > 0:  # a span's start: its length, then -1 for the rest; apart from the next span
                assert span <= 2 and spans[w + 1 : w + span] == [-1] * (span - 1)
                assert w + span == 20 or spans[w + span] == 0
        pieces, copy = trained.degrade("One, Two three Four, five six Seven eight nine Ten.", random.Random(seed))
        assert None in pieces and copy == " ".join(p for p in pieces if p is not None) and copy == copy.lower()


def test_agreement_script_exact_mode_equals_upstream(model_dir, tmp_path):
    out = tmp_path / "agreement.json"
    report = trained_agreement.main(["--model-dir", str(model_dir), "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text())["modes"].keys() == {"beam4", "greedy"}
    assert report["environment"]["cpu_kind"] in {"amx", "avx512", "avx2", "cpu"}
    for mode in report["modes"].values():
        assert mode["copy_baseline"].keys() == {"bleu", "chrf"}
        candidates = mode["candidates"]
        assert {"upstream", "fastgen_exact", "fastgen_fast"} <= candidates.keys()
        for exact in ("fastgen_exact", "fastgen_exact_upstream_step", "fastgen_exact_python_step"):  # each step
            assert candidates[exact]["vs_upstream"] == {"sequence_match": 1.0, "token_agreement": 1.0}
        assert all({"bleu", "chrf", "median_wall_seconds", "vs_upstream"} <= c.keys() for c in candidates.values())
        assert ("fastgen_int8" in candidates) == report["int8_feature"]


def test_the_step_switches_are_fastgens():
    from fastgen.models import compiled_step
    from fastgen.optimizer.transformers import beam_search

    assert trained_agreement.LEAN_ENV == beam_search.LEAN_ENV
    assert trained_agreement.COMPILED_ENV == compiled_step.ENV


def test_agreement_and_the_paired_test():
    reference = [[7, 8, 9], [7, 8, 9], [7, 8, 9]]
    other = [[7, 5, 9], [7, 8, 6], [7, 8, 9]]
    assert trained_agreement.agreement(reference, other) == {"sequence_match": 1 / 3, "token_agreement": 7 / 9}
    # 6 discordant pairs all one way: p = 2 / 2**6; a balanced split: p = 1
    assert trained_agreement.mcnemar_exact([True] * 6 + [False], [False] * 7) == {
        "only_first": 6,
        "only_second": 0,
        "p_value": 2 / 64,
    }
    assert trained_agreement.mcnemar_exact([True, False], [False, True])["p_value"] == 1.0
    scipy_stats = pytest.importorskip("scipy.stats")
    first, second = [True] * 30 + [False] * 12, [False] * 30 + [True] * 12
    expected = scipy_stats.binomtest(12, 42, 0.5).pvalue
    assert trained_agreement.mcnemar_exact(first, second)["p_value"] == pytest.approx(expected, rel=1e-12)


def test_linear_groups_cover_every_linear_by_layer_and_by_kind():
    model = trained.build_model(64, 16, (2, 1), 2, 32)
    groups = trained_agreement.linear_groups(model)
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    by_layer = [g for g in groups if g.split(".")[-1].isdigit() or g == "lm_head"]
    assert set().union(*(groups[g] for g in by_layer)) == linears
    assert sorted(by_layer) == ["decoder.layers.0", "encoder.layers.0", "encoder.layers.1", "lm_head"]
    assert len(groups["decoder fc2"]) == 1 and len(groups["encoder self_attn.qkv"]) == 6
    head = model.get_output_embeddings()
    with trained_agreement.kept_fp32(model, ["lm_head"]):
        assert "forward" in head.__dict__
    assert "forward" not in head.__dict__
