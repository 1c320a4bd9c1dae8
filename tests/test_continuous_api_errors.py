"""``generate_many`` on calls it does not serve and on what a user gets wrong (issue 24).

A call that falls back returns, per input, what ``generate`` returns for that input alone (upstream's,
``fastgen.unpatched()``): no padding of a static batch, and with ``return_dict_in_generate=True`` one
output object per input. Arguments that ``generate`` would reject, or that ``generate_many`` would
misread, fail at once with a message naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import fastgen
from fastgen.continuous import generate_many
from tests import continuous_cases, harness
from tests.continuous_cases import make_inputs

#: EOS gains that make the tiny models' outputs end at very different steps (as in the served-path tests)
EOS_GAIN = {"bart": 2.0, "llama": 2.0, "gpt2": 4.0}


@pytest.fixture(scope="module")
def models():
    built = {family: continuous_cases.eos_model(family, gain) for family, gain in EOS_GAIN.items()}
    config = transformers.BlenderbotSmallConfig(**harness.HF_FAMILIES["bart"][2])
    torch.manual_seed(0)
    built["blenderbot-small"] = transformers.BlenderbotSmallForConditionalGeneration(config).eval()
    built["blenderbot-small"].generation_config.pad_token_id = harness.PAD
    with torch.no_grad():  # the EOS gain of continuous_cases.eos_model
        built["blenderbot-small"].get_output_embeddings().weight[harness.EOS] *= 3.0
    built["gemma2"] = harness.tiny_hf_model("gemma2")
    return built


def upstream_alone(model, ids, kwargs, **extra):
    with fastgen.unpatched(), torch.inference_mode():
        return model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **kwargs, **extra)


# -- fallback results are generate's on each input alone ----------------------------------------------------
FALLBACKS = [
    # (model, kwargs, the reason the warning names): a setting, or a family continuous batching does not serve
    ("bart", dict(bad_words_ids=[[7]], max_new_tokens=12), "bad_words_ids"),
    ("bart", dict(num_beams=3, bad_words_ids=[[7]], max_new_tokens=12), "bad_words_ids"),
    ("blenderbot-small", dict(num_beams=2, max_new_tokens=10), "blenderbot-small"),
    ("llama", dict(bad_words_ids=[[7]], max_new_tokens=12), "bad_words_ids"),
    ("llama", dict(num_beams=3, num_return_sequences=2, repetition_penalty=1.3, max_new_tokens=12), "repetition"),
    ("gpt2", dict(num_beams=2, max_length=45, repetition_penalty=1.2), "repetition_penalty"),
    ("gemma2", dict(max_new_tokens=8), "gemma2"),
]


@pytest.mark.parametrize(
    "family, kwargs, reason", FALLBACKS, ids=[f"{f}-{r}-{k.get('num_beams', 1)}" for f, k, r in FALLBACKS]
)
def test_fallback_results_are_generate_on_each_input_alone(models, family, kwargs, reason):
    """Before issue 24 a fallback returned each input's rows of a padded static batch: trailing pads
    (encoder-decoder) or left pads (decoder-only), so a result's shape depended on its batch."""
    model = models[family]
    inputs = make_inputs(6, seed=11)
    with fastgen.report() as rep:
        results = list(generate_many(model, inputs, batch_rows=8, return_scores=True, **kwargs))
    assert any(f == "continuous" and reason in why for f, why in rep.fell_back), rep.fell_back
    lengths = set()
    for index, (ids, (sequences, scores)) in enumerate(zip(inputs, results, strict=True)):
        ref = upstream_alone(model, ids, kwargs, return_dict_in_generate=True, output_scores=True)
        assert torch.equal(sequences, ref.sequences), f"input {index}: {sequences.tolist()} != {ref.sequences.tolist()}"
        if kwargs.get("num_beams", 1) > 1:
            torch.testing.assert_close(scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)
        else:
            assert scores is None
        lengths.add(sequences.shape[1] - (0 if model.config.is_encoder_decoder else len(ids)))
    assert len(lengths) > 1, "outputs should end at different steps, or padding would not show"


def test_return_dict_in_generate_gives_generates_output_per_input(models):
    """Before issue 24: result 0 was a tuple of the whole batch's sequences, result 1 its beam_indices, ..."""
    model, kwargs = models["bart"], dict(num_beams=2, max_new_tokens=10, output_scores=True)
    inputs = make_inputs(4, seed=12)
    results = list(generate_many(model, inputs, batch_rows=4, return_dict_in_generate=True, **kwargs))
    assert len(results) == len(inputs)
    for ids, out in zip(inputs, results, strict=True):
        ref = upstream_alone(model, ids, kwargs, return_dict_in_generate=True)
        assert type(out) is type(ref)
        assert torch.equal(out.sequences, ref.sequences) and torch.equal(out.beam_indices, ref.beam_indices)
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)
        assert len(out.scores) == len(ref.scores) and out.scores[0].shape == ref.scores[0].shape
    with pytest.raises(ValueError, match="return_scores=True with return_dict_in_generate=True"):
        generate_many(model, inputs, return_scores=True, return_dict_in_generate=True)


def test_sampling_fallback_without_seed_draws_one_seed_from_the_global_generator(models):
    """As on the served path: S drawn once from torch's global generator, input i sampled alone from S + i."""
    model, kwargs = models["bart"], dict(do_sample=True, num_beams=2, max_new_tokens=8)
    inputs = make_inputs(3, seed=13)
    torch.manual_seed(4)
    results = list(generate_many(model, inputs, **kwargs))
    torch.manual_seed(4)
    start = int(torch.randint(0, 2**62, ()).item())
    for index, (ids, result) in enumerate(zip(inputs, results, strict=True)):
        torch.manual_seed(start + index)
        assert torch.equal(result, upstream_alone(model, ids, kwargs))


#: fallbacks where padded static batches, cut to each input's width, are exact (encoder-decoder, not sampling,
#: decoder-side settings), and ones that run each input alone
STATIC_OR_ALONE = [
    ("blenderbot-small", dict(num_beams=3, num_return_sequences=2, max_new_tokens=10), True),
    ("blenderbot-small", dict(max_new_tokens=10, min_new_tokens=2), True),
    ("bart", dict(num_beams=2, suppress_tokens=[8], bad_words_ids=[[7]], max_new_tokens=10), True),
    ("bart", dict(repetition_penalty=1.05, max_new_tokens=10), True),
    ("bart", dict(encoder_repetition_penalty=1.2, max_new_tokens=10), False),  # reads the encoder's pads
    ("bart", dict(num_beams=2, max_new_tokens=10, logits_processor=transformers.LogitsProcessorList()), False),
    ("llama", dict(num_beams=2, repetition_penalty=1.2, max_new_tokens=10), False),  # left pads are read
]


@pytest.mark.parametrize("family, kwargs, batched", STATIC_OR_ALONE)
def test_static_batches_only_where_cutting_them_is_exact(models, monkeypatch, family, kwargs, batched):
    model = models[family]
    inputs = make_inputs(8, seed=17)
    calls = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw["input_ids"].shape[0]) or original(**kw))
    results = list(generate_many(model, inputs, batch_rows=4 * kwargs.get("num_beams", 1), **kwargs))
    monkeypatch.undo()
    assert calls == ([4, 4] if batched else [1] * len(inputs)), calls
    widths = set()
    for index, (ids, result) in enumerate(zip(inputs, results, strict=True)):
        expected = upstream_alone(model, ids, kwargs)
        assert torch.equal(result, expected), f"input {index}: {result.tolist()} != {expected.tolist()}"
        widths.add(result.shape[1])
    assert len(widths) > 1, "outputs should end at different steps, or a cut would not show"


def test_a_real_pad_token_inside_an_output_is_kept(models):
    """The cut is after each row's EOS, never at pad tokens: a model that often emits the pad id keeps them."""
    model = models["blenderbot-small"]
    saved = model.get_output_embeddings().weight.detach().clone()
    with torch.no_grad():
        model.get_output_embeddings().weight[harness.PAD] *= 3.0
    try:
        kwargs = dict(num_beams=2, max_new_tokens=12)
        inputs = make_inputs(8, seed=18)
        results = list(generate_many(model, inputs, batch_rows=8, **kwargs))
        expected = [upstream_alone(model, ids, kwargs) for ids in inputs]
    finally:
        with torch.no_grad():
            model.get_output_embeddings().weight.copy_(saved)
    assert all(torch.equal(r, e) for r, e in zip(results, expected, strict=True))
    inner = [r[0, 1:-1] for r in results]
    assert any(bool((row == harness.PAD).any()) for row in inner), "no pad token inside an output: a weak test"


# -- seeds --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [np.int64(5), torch.tensor(5), np.array(5)], ids=["numpy", "tensor", "array0d"])
def test_numpy_and_tensor_integer_seeds_work_as_ints(models, seed):
    model, kwargs = models["bart"], dict(do_sample=True, max_new_tokens=8)
    inputs = make_inputs(3, seed=14)
    expected = list(generate_many(model, inputs, seed=5, **kwargs))
    assert all(
        torch.equal(r, e) for r, e in zip(generate_many(model, inputs, seed=seed, **kwargs), expected, strict=True)
    )
    per_input = [seed + i for i in range(len(inputs))]  # numpy or tensor seeds in an iterable too
    assert all(
        torch.equal(r, e) for r, e in zip(generate_many(model, inputs, seed=per_input, **kwargs), expected, strict=True)
    )


@pytest.mark.parametrize(
    "seed, message",
    [
        (1.5, r"seed must be an integer or an iterable of one integer per input, got float 1\.5"),
        ("abc", "seed must be an integer or an iterable of one integer per input, got str 'abc'"),
        (True, "got bool True"),
        (torch.tensor(2.5), "got Tensor"),
    ],
)
def test_bad_seeds_are_a_clear_type_error(models, seed, message):
    with pytest.raises(TypeError, match=message):
        generate_many(models["bart"], make_inputs(2), do_sample=True, seed=seed, max_new_tokens=4)


def test_a_bad_seed_in_an_iterable_names_its_input(models):
    with pytest.raises(TypeError, match=r"seed of input 1: must be an integer, got float 1\.5"):
        list(generate_many(models["bart"], make_inputs(3), do_sample=True, seed=[3, 1.5, 4], max_new_tokens=4))


# -- inputs -------------------------------------------------------------------------------------------------
def test_attention_mask_is_refused(models):
    inputs = make_inputs(2)
    with pytest.raises(TypeError, match="got attention_mask=: it takes unpadded 1-D inputs"):
        generate_many(models["bart"], inputs, attention_mask=torch.ones(2, 40, dtype=torch.long))
    with pytest.raises(TypeError, match="got input_ids="):
        generate_many(models["bart"], inputs, input_ids=torch.ones(2, 40, dtype=torch.long))


def _padded(inputs, pad, left):
    width = max(len(i) for i in inputs)
    ids, mask = torch.full((len(inputs), width), pad), torch.zeros((len(inputs), width), dtype=torch.long)
    for row, tokens in enumerate(inputs):
        span = slice(width - len(tokens), width) if left else slice(0, len(tokens))
        ids[row, span], mask[row, span] = tokens, 1
    return ids, mask


@pytest.mark.parametrize("family, left", [("bart", False), ("llama", True)])
def test_a_tokenizers_padded_output_is_read_under_its_mask(models, family, left):
    """A tokenizer's ``BatchEncoding`` (or any mapping of input_ids and attention_mask) is accepted: each
    row's tokens under its mask are one input, so the results equal those of the unpadded rows."""
    model, kwargs = models[family], dict(num_beams=2, max_new_tokens=8)
    inputs = make_inputs(4, seed=15)
    ids, mask = _padded(inputs, harness.PAD, left)
    expected = list(generate_many(model, inputs, **kwargs))
    for encoding in (
        transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask}),
        {"input_ids": [r.tolist() for r in ids], "attention_mask": mask.tolist()},
    ):
        results = list(generate_many(model, encoding, **kwargs))
        assert all(torch.equal(r, e) for r, e in zip(results, expected, strict=True))


def test_bad_tokenizer_outputs_are_refused(models):
    model = models["bart"]
    ids, mask = _padded(make_inputs(2), harness.PAD, left=False)
    holed = mask.clone()
    holed[0, 1] = 0
    with pytest.raises(ValueError, match="input 0: attention_mask is not one run of ones"):
        list(generate_many(model, {"input_ids": ids, "attention_mask": holed}, max_new_tokens=4))
    with pytest.raises(ValueError, match="input_ids and attention_mask only"):
        generate_many(model, {"input_ids": ids, "attention_mask": mask, "token_type_ids": mask}, max_new_tokens=4)


def test_a_padded_2d_tensor_is_refused_and_an_unpadded_one_taken_by_rows(models):
    model, kwargs = models["bart"], dict(max_new_tokens=6)
    inputs = make_inputs(3, seed=16)
    padded, _ = _padded(inputs, harness.PAD, left=False)
    with pytest.raises(ValueError, match=f"2-D tensor holding the pad token id {harness.PAD}"):
        generate_many(model, padded, **kwargs)
    equal = torch.stack([i[:2] for i in inputs])  # no pad id anywhere: nothing to tell, rows are inputs
    results = list(generate_many(model, equal, **kwargs))
    assert all(torch.equal(r, e) for r, e in zip(results, generate_many(model, list(equal), **kwargs), strict=True))
    with pytest.raises(ValueError, match=r"tensor of shape \(5,\).*one input: pass \[ids\]"):
        generate_many(model, torch.arange(3, 8), **kwargs)


@pytest.mark.parametrize(
    "inputs, error, message",
    [
        ("some text", TypeError, "inputs is a string"),
        (["some text"], TypeError, "input 0: a string"),
        ([[5, 6], [7, 500]], ValueError, r"input 1: token id 500 is outside the vocabulary \(0\.\.95\)"),
        ([[5, -1]], ValueError, "input 0: token id -1 is outside the vocabulary"),
        ([[5.0, 6.0]], TypeError, "input 0: token ids must be integers"),
        ([[5, 6], []], ValueError, "input 1: expected a non-empty 1-D sequence"),
        (
            [[[5, 6], [7, 8]]],
            ValueError,
            r"input 0: expected a non-empty 1-D sequence of token ids, got shape \(2, 2\)",
        ),
        ([object()], TypeError, "input 0: expected a 1-D sequence of token ids, got object"),
    ],
)
def test_bad_inputs_are_clear_errors(models, inputs, error, message):
    with pytest.raises(error, match=message):
        list(generate_many(models["bart"], inputs, max_new_tokens=4))


# -- arguments ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bart", "llama"])
def test_zero_beams_raise_as_generate_raises(models, family):
    """``generate`` raises for num_beams=0 (a ZeroDivisionError deep in its loop); generate_many ran greedy."""
    model, ids = models[family], make_inputs(1)[0]
    with pytest.raises(ZeroDivisionError):
        upstream_alone(model, ids, dict(num_beams=0, max_new_tokens=4))
    with pytest.raises(ValueError, match="num_beams must be a positive integer, got 0"):
        generate_many(model, [ids], num_beams=0, max_new_tokens=4)


@pytest.mark.parametrize("rows", [True, 0, -2, 2.0, "4"])
def test_batch_rows_must_be_a_row_count(models, rows):
    with pytest.raises(ValueError, match="batch_rows must be a positive integer"):
        generate_many(models["bart"], make_inputs(2), batch_rows=rows)


def test_a_numpy_batch_rows_is_a_row_count(models):
    inputs = make_inputs(3)
    results = list(generate_many(models["bart"], inputs, batch_rows=np.int64(2), max_new_tokens=4))
    assert len(results) == 3


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_beams=2, length_penalty="abc"), TypeError, "length_penalty must be a number, got str 'abc'"),
        (dict(num_beams=2, early_stopping="maybe"), ValueError, "early_stopping"),
        (dict(do_sample=True, temperature=0), ValueError, "temperature"),
        (dict(do_sample=True, top_k=-3), ValueError, "top_k"),
        (dict(do_sample=True, min_p=5), ValueError, "min_p"),
        (dict(num_return_sequences=0), ValueError, "num_return_sequences must be a positive integer"),
    ],
)
def test_values_generate_rejects_are_rejected(models, kwargs, error, message):
    with pytest.raises(error, match=message):
        list(generate_many(models["bart"], make_inputs(2), max_new_tokens=4, **kwargs))
