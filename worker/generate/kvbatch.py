"""The running batch's KV cache: one transformers DynamicCache whose rows are the running
sequences, left-padded to a common width with an attention mask that hides the padding.

A sequence joins at a decode-step boundary after its own prefill (a batch-1 DynamicCache of its
prompt): both caches are left-padded to the wider width and concatenated on the batch
dimension. A sequence leaves by dropping its row (DynamicCache.batch_select_indices), then
the columns that are padding in every remaining row are trimmed. Each decode step feeds every
row its last token at its own position (the number of real tokens before it), so padding never
shifts a row's rotary positions.

Width: every row grows by one column per step, so the padded width is the longest running
sequence; the cache holds rows x width tokens, which is what the KV plan reserves
(worker/generate/kvplan.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

# forward(input_ids [B, T], attention_mask [B, past + T], position_ids [B, T], cache) -> logits [B, V]
StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor]


class KVBatch:
    """The rows of the running batch, in join order; `lengths[i]` real tokens in row i."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, width] int64, 0 = padding
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def cache_bytes(self) -> int:
        """Bytes the cache's key and value tensors hold now (rows x width x per-token bytes)."""
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in _layers(self.cache) for t in _tensors(layer))

    def join(self, cache: DynamicCache, length: int) -> None:
        """Append a prefilled batch-1 `cache` of `length` tokens as the last row."""
        mask = torch.ones((1, length), dtype=torch.long, device=_device(cache))
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.lengths = cache, mask, [length]
            return
        width = max(self.width, length)
        for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)], dim=0)
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(mask, (width - length, 0))], dim=0)
        self.lengths.append(length)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (indexes, in order); the others leave and their cache is freed."""
        if not rows:
            self.cache, self.mask, self.lengths = None, None, []
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.lengths = [self.lengths[r] for r in rows]
        drop = self.width - max(self.lengths)  # columns that are padding in every row left
        if drop > 0:
            self.mask = self.mask[:, drop:]
            for layer in _layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, drop:], layer.values[:, :, drop:]

    def step(self, forward: StepForward, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: row i gets `tokens[i]` at position lengths[i]. Returns [rows, vocab] logits."""
        assert self.cache is not None and self.mask is not None
        device = self.mask.device
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device)[:, None]
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)[:, None]
        self.mask = F.pad(self.mask, (0, 1), value=1)
        logits = forward(ids, self.mask, positions, self.cache)
        self.lengths = [n + 1 for n in self.lengths]
        return logits


def _tensors(layer: object) -> list[torch.Tensor]:
    return [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; each holds `keys` and `values`, [batch, kv heads, seq, head dim]."""
    return list(cache.layers)


def _device(cache: DynamicCache) -> torch.device:
    device: torch.device = _layers(cache)[0].keys.device
    return device


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, heads, seq, dim] left-padded with zeros to `width` on the sequence dimension."""
    return F.pad(t, (0, 0, width - t.shape[2], 0)) if t.shape[2] < width else t
