"""benchmarks/ctranslate2_compare.py: the pieces that need no CTranslate2 and no real-size model."""

import transformers

from benchmarks import ctranslate2_compare as ct2


def test_stand_in_tokenizer_names_every_id_and_the_special_tokens():
    config = transformers.MarianConfig(vocab_size=20, pad_token_id=19, eos_token_id=0, decoder_start_token_id=19)
    tokenizer = ct2._StandInTokenizer(config)
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(20))
    assert tokenizer.eos_token == "</s>" and tokenizer.convert_ids_to_tokens(19) == "<pad>"
    assert tokenizer.unk_token == "<unk>" and vocab["<unk>"] not in (0, 19)
    assert tokenizer.convert_ids_to_tokens([5, 6]) == ["t5", "t6"]


def test_readme_table_has_a_row_per_committed_mode():
    table = ct2.readme_table()
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    results = sorted(ct2.Path(ct2.__file__).parent.glob("results/ctranslate2-*.json"))
    expected = sum(len(ct2.json.loads(p.read_text())["modes"]) for p in results)
    assert len(rows) == expected
    assert all(row.count("|") == table.splitlines()[0].count("|") for row in rows)
