"""The ragged (BASS-PAD) cache: after rows accept different numbers of tokens, each row's valid
entries are exactly the K/V of its own tokens, and nothing a row reads comes from outside them."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from fastgen.models.ragged_cache import RaggedCache
from fastgen.optimizer.transformers.contract import CACHE
from fastgen.optimizer.transformers.speculative import MODEL_FAMILIES
from tests.harness import tiny_hf_model, tiny_inputs


def _ragged_run(model, inputs, steps, seed=0):
    """Prefill, then ``steps`` forwards of m tokens each where row b keeps a random prefix of them.

    Returns the ragged cache and each row's kept tokens (prompt without padding + kept tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = RaggedCache(DynamicCache(config=model.config), mask.sum(-1))
    model(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE: cache.cache})
    kept = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    for m in steps:
        new = torch.randint(3, model.config.vocab_size, (ids.shape[0], m), generator=g)
        model(
            input_ids=new,
            attention_mask=cache.attention_mask(m),
            position_ids=cache.position_ids(m),
            **{CACHE: cache.cache},
        )
        keep = torch.randint(0, m + 1, (ids.shape[0],), generator=g)
        cache.commit(keep, m)
        for b, n in enumerate(keep.tolist()):
            kept[b] += new[b, :n].tolist()
    return cache, kept


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
def test_valid_entries_equal_each_rows_own_cache(family: str) -> None:
    model = tiny_hf_model(family)
    inputs = tiny_inputs(model, batch=4, length=9)
    with torch.no_grad():
        cache, kept = _ragged_run(model, inputs, steps=[4, 1, 6, 3])
        width = cache.width
        assert width == int(cache.lengths.max())
        assert cache.lengths.tolist() == [len(k) for k in kept]
        mask = cache.attention_mask(0)
        for b, tokens in enumerate(kept):
            n = len(tokens)
            assert mask[b].tolist() == [0] * (width - n) + [1] * n
            alone = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([tokens]), **{CACHE: alone})
            for layer, single in zip(cache.cache.layers, alone.layers, strict=True):
                torch.testing.assert_close(layer.keys[b, :, width - n :], single.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer.values[b, :, width - n :], single.values[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
def test_no_row_reads_its_padding(family: str) -> None:
    """Overwrite every padding slot with huge values: the next step's logits do not move."""
    model = tiny_hf_model(family)
    inputs = tiny_inputs(model, batch=5, length=8)
    with torch.no_grad():
        cache, kept = _ragged_run(model, inputs, steps=[5, 2])
        step = torch.randint(3, model.config.vocab_size, (5, 3), generator=torch.Generator().manual_seed(9))

        def next_logits(cache: RaggedCache) -> torch.Tensor:
            clone = RaggedCache(_copy(cache.cache, model), cache.lengths)
            return model(
                input_ids=step,
                attention_mask=clone.attention_mask(3),
                position_ids=clone.position_ids(3),
                **{CACHE: clone.cache},
            ).logits

        clean = next_logits(cache)
        padding = (cache.attention_mask(0) == 0)[:, None, :, None]
        for layer in cache.cache.layers:
            layer.keys = layer.keys.masked_fill(padding, 1e3)
            layer.values = layer.values.masked_fill(padding, -1e3)
        assert bool(padding.any()), "the test needs ragged rows"
        torch.testing.assert_close(next_logits(cache), clean, atol=1e-5, rtol=1e-5)
        # And the same logits as each row run alone on its own tokens.
        for b, tokens in enumerate(kept):
            alone = model(input_ids=torch.tensor([tokens + step[b].tolist()])).logits[0, -3:]
            torch.testing.assert_close(clean[b], alone, atol=1e-4, rtol=1e-4)


def _copy(cache: DynamicCache, model) -> DynamicCache:
    clone = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        clone.update(layer.keys.clone(), layer.values.clone(), index)
    return clone
