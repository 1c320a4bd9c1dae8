"""The shared-K/V attention reference and layout helpers against naive per-hypothesis attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.ops.attention import (
    group_beam_queries,
    layout_for_groups,
    merge_attention_states,
    prefix_shared_attention,
    shared_kv_attention,
    ungroup_beam_output,
    ungroup_beam_rows,
)


def _naive(query, key, value, mask, scale):
    """Every hypothesis gets its own copy of its input's K/V (what upstream beam search does)."""
    group = query.shape[0] // key.shape[0]
    key = key.repeat_interleave(group, 0).repeat_interleave(query.shape[1] // key.shape[1], 1)
    value = value.repeat_interleave(group, 0).repeat_interleave(query.shape[1] // value.shape[1], 1)
    scores = (query.double() @ key.double().transpose(-1, -2)) * scale
    if mask is not None:
        if mask.shape[0] not in (1, query.shape[0]):
            mask = mask.repeat_interleave(group, 0)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    lse = torch.logsumexp(scores, -1)
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    return (probs @ value.double()), lse


shapes = st.tuples(
    st.integers(1, 3),  # batch
    st.integers(1, 4),  # group
    st.sampled_from([(2, 2), (4, 2), (4, 1)]),  # heads, kv heads
    st.integers(1, 3),  # q
    st.integers(1, 9),  # S
    st.sampled_from([4, 8]),  # D
    st.sampled_from(["none", "shared", "per_row", "float"]),
)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_shared_kv_attention_matches_per_hypothesis_attention(shape, seed) -> None:
    batch, group, (heads, kv_heads), q_len, kv_len, dim, mask_kind = shape
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch * group, heads, q_len, dim, generator=gen)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(batch, kv_heads, kv_len, dim + 1, generator=gen)
    mask = None
    if mask_kind == "shared":
        mask = torch.rand(batch, 1, 1, kv_len, generator=gen) > 0.3
    elif mask_kind == "per_row":
        mask = torch.rand(batch * group, 1, q_len, kv_len, generator=gen) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(batch, heads, q_len, kv_len, generator=gen)
    out, lse = shared_kv_attention(query, key, value, mask, scale=0.5)
    ref_out, ref_lse = _naive(query, key, value, mask, 0.5)
    assert out.shape == (batch * group, heads, q_len, dim + 1) and lse.shape == (batch * group, heads, q_len)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    assert torch.all(out[~finite] == 0)


def test_fully_masked_rows_are_empty_and_merge_as_nothing() -> None:
    query = torch.randn(4, 2, 1, 8)
    key, value = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    out, lse = shared_kv_attention(query, key, value, mask)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    other, other_lse = shared_kv_attention(query, key, value)
    merged, merged_lse = merge_attention_states(out, lse, other, other_lse)
    torch.testing.assert_close(merged, other)
    torch.testing.assert_close(merged_lse, other_lse)


@pytest.mark.parametrize("group", [1, 3])
def test_merge_of_two_key_sets_equals_attention_over_both(group: int) -> None:
    """Shared prefix (one per input) + per-hypothesis suffix == attention over the concatenation."""
    torch.manual_seed(0)
    batch, heads, dim = 2, 2, 8
    query = torch.randn(batch * group, heads, 1, dim)
    prefix_k, prefix_v = torch.randn(batch, heads, 6, dim), torch.randn(batch, heads, 6, dim)
    suffix_k, suffix_v = torch.randn(batch * group, heads, 3, dim), torch.randn(batch * group, heads, 3, dim)
    prefix_mask = torch.tensor([[True] * 6, [False, False] + [True] * 4]).view(batch, 1, 1, 6)
    out_a, lse_a = shared_kv_attention(query, prefix_k, prefix_v, prefix_mask)
    out_b, lse_b = shared_kv_attention(query, suffix_k, suffix_v)
    merged, merged_lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    full_k = torch.cat([prefix_k.repeat_interleave(group, 0), suffix_k], dim=2)
    full_v = torch.cat([prefix_v.repeat_interleave(group, 0), suffix_v], dim=2)
    full_mask = torch.cat([prefix_mask.repeat_interleave(group, 0), torch.ones(batch * group, 1, 1, 3).bool()], -1)
    expected, expected_lse = shared_kv_attention(query, full_k, full_v, full_mask)
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merged_lse, expected_lse, atol=1e-6, rtol=1e-5)


def test_layout_round_trips() -> None:
    batch, group, heads, q_len, dim = 2, 3, 4, 2, 5
    query = torch.randn(batch * group, heads, q_len, dim)
    grouped = group_beam_queries(query, group)
    assert grouped.shape == (batch, heads, group * q_len, dim)
    assert torch.equal(grouped[1, :, 2 * q_len : 3 * q_len], query[1 * group + 2])
    assert torch.equal(ungroup_beam_rows(grouped, group), query)
    transposed = grouped.transpose(1, 2).contiguous()  # how attention functions return outputs
    assert torch.equal(ungroup_beam_output(transposed, group), query.transpose(1, 2))


def test_layout_for_groups_shapes() -> None:
    batch, group, q_len, kv_len = 2, 3, 2, 7
    shared_row = torch.randn(batch, 1, 1, kv_len)
    assert layout_for_groups(shared_row, batch, group, q_len) is shared_row  # broadcasts as is
    shared_q = torch.randn(1, 4, q_len, kv_len)
    tiled = layout_for_groups(shared_q, batch, group, q_len)
    assert tiled.shape == (1, 4, group * q_len, kv_len)
    assert torch.equal(tiled[:, :, q_len : 2 * q_len], shared_q)
    per_row = torch.randn(batch * group, 1, q_len, kv_len)
    assert torch.equal(layout_for_groups(per_row, batch, group, q_len), group_beam_queries(per_row, group))
    assert layout_for_groups(torch.randn(5, 1, 1, kv_len), batch, group, q_len) is None
    assert layout_for_groups(torch.randn(batch, 1, 3, kv_len), batch, group, q_len) is None


prefix_shapes = st.tuples(
    st.integers(1, 3),  # batch
    st.integers(1, 4),  # group
    st.sampled_from([(2, 2), (4, 2), (4, 1)]),  # heads, kv heads
    st.integers(1, 3),  # q
    st.integers(1, 9),  # P
    st.integers(0, 4),  # T (0: the first decoding step's state before its own token)
    st.sampled_from(["none", "bool_per_row", "bool_broadcast", "float"]),
)


@settings(max_examples=60, deadline=None)
@given(shape=prefix_shapes, seed=st.integers(0, 2**16))
def test_prefix_shared_attention_matches_attention_over_the_concatenation(shape, seed) -> None:
    """Shared prefix + own suffix == plain attention over each hypothesis' ``[prefix ; suffix]`` (and the lse merge)."""
    batch, group, (heads, kv_heads), q_len, prefix_len, suffix_len, mask_kind = shape
    rows, total, dim = batch * group, prefix_len + suffix_len + q_len, 8
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, q_len, dim, generator=gen)
    prefix_k, prefix_v = (
        torch.randn(batch, kv_heads, prefix_len, dim, generator=gen),
        torch.randn(batch, kv_heads, prefix_len, dim + 1, generator=gen),
    )
    # The suffix includes the queries' own tokens, as after a cache update.
    suffix_k = torch.randn(rows, kv_heads, total - prefix_len, dim, generator=gen)
    suffix_v = torch.randn(rows, kv_heads, total - prefix_len, dim + 1, generator=gen)
    mask = None
    if mask_kind == "bool_per_row":
        mask = torch.rand(rows, 1, q_len, total, generator=gen) > 0.3
        mask[..., -1] = True  # every query sees at least one key, as a causal mask guarantees
    elif mask_kind == "bool_broadcast":
        mask = (torch.rand(1, 1, q_len, total, generator=gen) > 0.3) | (torch.arange(total) == total - 1)
    elif mask_kind == "float":
        mask = torch.randn(rows, heads, q_len, total, generator=gen)
    out, weights = prefix_shared_attention(
        query, prefix_k, prefix_v, suffix_k, suffix_v, mask, scale=0.5, return_weights=True
    )
    full_k = torch.cat([prefix_k.repeat_interleave(group, 0), suffix_k], dim=2)
    full_v = torch.cat([prefix_v.repeat_interleave(group, 0), suffix_v], dim=2)
    expected, _ = _naive(query, full_k, full_v, mask, 0.5)
    assert out.shape == (rows, heads, q_len, dim + 1) and weights.shape == (rows, heads, q_len, total)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(rows, heads, q_len), atol=1e-5, rtol=1e-5)
    if mask is None or mask.dtype == torch.bool:  # same thing via two lse states and a merge
        prefix_mask = None if mask is None else mask[..., :prefix_len].expand(rows, 1, q_len, prefix_len)
        suffix_mask = None if mask is None else mask[..., prefix_len:].expand(rows, 1, q_len, total - prefix_len)
        out_a, lse_a = shared_kv_attention(query, prefix_k, prefix_v, prefix_mask, scale=0.5)
        out_b, lse_b = shared_kv_attention(query, suffix_k, suffix_v, suffix_mask, scale=0.5)
        merged, _ = merge_attention_states(out_a, lse_a, out_b, lse_b)
        torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)


def test_prefix_shared_attention_weights_are_eager_probabilities() -> None:
    """The returned weights are what eager attention returns over the concatenated keys."""
    torch.manual_seed(0)
    batch, group, heads, dim = 2, 3, 4, 8
    query = torch.randn(batch * group, heads, 1, dim)
    prefix_k, prefix_v = torch.randn(batch, heads, 5, dim), torch.randn(batch, heads, 5, dim)
    suffix_k, suffix_v = torch.randn(batch * group, heads, 2, dim), torch.randn(batch * group, heads, 2, dim)
    full_k = torch.cat([prefix_k.repeat_interleave(group, 0), suffix_k], dim=2)
    probs = torch.softmax(torch.matmul(query, full_k.transpose(-1, -2)) * dim**-0.5, dim=-1)
    _, weights = prefix_shared_attention(query, prefix_k, prefix_v, suffix_k, suffix_v, return_weights=True)
    torch.testing.assert_close(weights, probs, atol=1e-7, rtol=1e-6)
