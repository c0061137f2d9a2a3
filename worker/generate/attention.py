"""Attention for a packed step (worker/generate/causal_lm.py): each sequence's queries against its own
keys and values only, through torch's scaled_dot_product_attention (SDPA). No kernel of ours: the
arithmetic is torch's SDPA.

A step's decodes (one query each) are attended in groups, one SDPA call a group: the sequences of a
group are read back from the pool into rows of one width, the group's longest context, each row's
tail padded and masked. That is one call where there were as many as sequences, the layout vLLM's
paged-attention kernel computes decodes in. Padding costs reads and scores, so a group takes
sequences of nearly the same length (`decode_groups`, PAD_KEYS): 32 streams started together make
one group, a chat workload's mixed lengths many, and contexts far apart stay one call each.

A prefill chunk (more than one query) is its own call with a causal mask aligned to the bottom
right (its queries are the last of its keys' positions).

Why not transformers' `sdpa` over the packed row with its block-diagonal mask (what its continuous
batching does without flash attention): that computes every query against every key of the step and
masks the rest, T x K scores for T step tokens and K cached tokens read, so 32 decoding sequences of
300 tokens cost 32 x 9,600 scores a head where their own attention is 32 x 300.

Registered with transformers' AttentionInterface as ATTENTION; PagedAttentionCache.update has
already written the step's keys and values and read each call's keys and values back (in the
layout's order, padding included) before this runs, and with that cache the model builds no mask.
The layout (`StepLayout`) is worked out once per step, not once per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "vramguard_packed_sdpa"
# Padding a decode group's row by one key costs about 0.29 us (read back 0.15, scored 0.14); one
# SDPA call fewer saves about 10 us plus its views: worth about 35-45 padded keys (the 2-core CPU,
# SmolLM2's heads, 32 decodes: 32 calls of 30 keys 0.46 ms a layer, of 80 0.67, of 300 1.69; a
# token's keys or values read back 1.1 ms for 15,000).
PAD_KEYS = 32


@dataclass(frozen=True, slots=True)
class Call:
    """One SDPA call of a step: `rows` sequences of `queries` queries each (a decode group: rows of
    one query; a prefill chunk: one row), each row's keys padded to `width`. `mask` (bool, True:
    attend): [rows, 1, 1, width] for a decode group whose rows are padded, [queries, width] (causal,
    bottom right) for a prefill chunk, None where every row sees all its `width` keys."""

    rows: int
    queries: int
    width: int
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class StepLayout:
    """A packed step's SDPA calls, in the order of its queries and of its keys read back. Passed to
    every layer as the `step_layout` keyword."""

    calls: tuple[Call, ...]

    @property
    def queries(self) -> list[int]:
        return [c.rows * c.queries for c in self.calls]

    @property
    def keys(self) -> list[int]:
        return [c.rows * c.width for c in self.calls]

    @classmethod
    def of(cls, decode_keys: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]],
           device: str | torch.device) -> StepLayout:
        """`decode_keys`: each decode group's context lengths (keys of its sequences, as
        `decode_groups` formed them); `chunks`: each prefill chunk's (queries, keys)."""
        calls = []
        for lengths in decode_keys:
            width = max(lengths)
            mask = None
            if min(lengths) < width:
                mask = (torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None])
                mask = mask[:, None, None, :]
            calls.append(Call(len(lengths), 1, width, mask))
        for q, k in chunks:
            mask = torch.ones((q, k), dtype=torch.bool, device=device).tril(diagonal=k - q)
            calls.append(Call(1, q, k, mask))
        return cls(tuple(calls))


def decode_groups(lengths: Sequence[int]) -> list[int]:
    """Sizes of the groups that decodes of context `lengths` (tokens, longest first) are attended in,
    one SDPA call a group: a sequence joins the group before it while its padding (the group's
    width, its first length, minus its own) is at most PAD_KEYS keys."""
    sizes: list[int] = []
    width = None
    for length in lengths:
        if width is not None and width - length <= PAD_KEYS:
            sizes[-1] += 1
        else:
            sizes.append(1)
            width = length
    return sizes


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, dim], key and value [1, kv heads, K, dim] (the calls one after the other,
    as kwarg `step_layout` places them: causal_lm.packed_inputs). Returns [1, T, heads, dim] and no
    weights. Without a layout (a forward without the pool: warm-up, probe) it is transformers'
    sdpa, with sdpa's mask."""
    layout: StepLayout | None = kwargs.get("step_layout")
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    out = []
    # One split a tensor, not three slicings a call: at 32 calls the views cost about as much as
    # the attention (measured: a layer's attention 1.0-1.2 -> 0.8 ms).
    for call, q, k, v in zip(layout.calls, torch.split(query[0], layout.queries, dim=1),
                             torch.split(key[0], layout.keys, dim=1), torch.split(value[0], layout.keys, dim=1),
                             strict=True):
        # [heads, rows x queries, dim] -> [rows, heads, queries, dim]; keys [rows, kv heads, width, dim]
        q, k, v = (x.view(x.shape[0], call.rows, -1, x.shape[2]).transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=call.mask, scale=scaling, enable_gqa=gqa)
        out.append(o.transpose(0, 1).flatten(1, 2))  # [heads, rows x queries, dim]
    return torch.cat(out, dim=1).transpose(0, 1).unsqueeze(0).contiguous(), None


AttentionInterface.register(ATTENTION, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # forwards without the pool: sdpa's mask
