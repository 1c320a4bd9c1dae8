"""BASS-PAD bookkeeping for a batch whose rows hold different numbers of tokens in one KV cache.

Speculative decoding lets each row accept its own number of draft tokens, so after a step the rows
of a cache are ragged. fastgen keeps Transformers' ``DynamicCache`` (one ``(B, H, T, D)`` tensor per
layer and K/V) and stores every row *right-aligned*: row ``b``'s valid entries are the last
``lengths[b]`` of the ``T`` slots, the slots before them are padding that the 2D attention mask
hides (exactly how left-padded prompts already look). ``T`` is the batch maximum, so the padding
never grows beyond what the longest row needs.

After a forward that appended ``m`` entries to every row, :meth:`RaggedCache.commit` keeps the
first ``keep[b]`` of them for row ``b`` and re-aligns the rows with one gather per layer: rejected
draft entries leave the cache, and the next step appends at a common end again. Positions
(``position_ids``) follow the valid entries, not the slots, so RoPE and learned position embeddings
see the same numbers as in regular decoding.
"""

from __future__ import annotations

import torch


class RaggedCache:
    """Per-row valid lengths of a right-aligned ``DynamicCache`` (see the module docstring)."""

    def __init__(self, cache, lengths: torch.Tensor) -> None:
        self.cache = cache
        self.lengths = lengths  # (B,) valid entries per row

    @property
    def width(self) -> int:
        return self.cache.get_seq_length() if len(self.cache.layers) else 0

    def attention_mask(self, new_tokens: int) -> torch.Tensor:
        """2D mask over the cache slots plus ``new_tokens`` appended ones: 1 where a row has a valid entry."""
        width = self.width
        slots = torch.arange(width + new_tokens, device=self.lengths.device)
        return (slots >= (width - self.lengths)[:, None]).long()

    def position_ids(self, new_tokens: int) -> torch.Tensor:
        """Positions of ``new_tokens`` appended tokens: they follow each row's valid entries."""
        return self.lengths[:, None] + torch.arange(new_tokens, device=self.lengths.device)

    def commit(self, keep: torch.Tensor, appended: int, rows: torch.Tensor | None = None) -> None:
        """Keep the first ``keep[b]`` of the ``appended`` newest entries of each row, drop the rest,
        optionally keep only ``rows`` of the batch, and right-align the rows again."""
        if rows is not None:
            keep, self.lengths = keep[rows], self.lengths[rows]
        new_lengths = self.lengths + keep
        width = int(new_lengths.max()) if new_lengths.numel() else 0
        old_width = self.width
        if old_width:
            # Output slot t of row b reads old slot end_b - width + t, end_b = first slot after its kept entries.
            end = old_width - appended + keep
            source = (end[:, None] - width + torch.arange(width, device=keep.device)).clamp_(min=0)
            uniform = rows is None and bool((keep == appended).all()) and width == old_width
            for layer in self.cache.layers:
                if uniform:
                    break
                keys, values = layer.keys, layer.values
                if rows is not None:
                    keys, values = keys.index_select(0, rows), values.index_select(0, rows)
                index = source[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
                layer.keys, layer.values = keys.gather(2, index), values.gather(2, index)
        self.lengths = new_lengths
