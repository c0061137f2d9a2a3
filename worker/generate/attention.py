"""Attention for a packed step (worker/generate/causal_lm.py): each sequence's queries against its own
keys and values, through torch's scaled_dot_product_attention, one call per sequence.

Why not transformers' `sdpa` over the packed row with its block-diagonal mask (what its continuous
batching does without flash attention): that computes every query against every key of the step and
masks the rest, T x K scores for T step tokens and K cached tokens read, so 32 decoding sequences of
300 tokens cost 32 x 9,600 scores a head where their own attention is 32 x 300; on a CPU that was
most of a step. Why not one padded SDPA call for all the step's decodes: gathering each sequence's
keys into a padded [sequences, heads, longest, dim] tensor costs more than it saves (measured on
the 2-core CPU, SmolLM2's heads: 32 decodes of 80 tokens 2.1 ms a layer padded against 1.0 ms one
call each; of 400 tokens 12.5 against 3.3 ms). Per sequence, the work is each sequence's own, and
a sequence's attention does not depend on what else is in the step. No kernel of ours: the
arithmetic is torch's SDPA.

Registered with transformers' AttentionInterface as ATTENTION; PagedAttentionCache.update has
already written the step's keys and values and read each sequence's whole context back (in
`cu_seq_lens_k` order) before this runs, and with that cache the model builds no mask. Where each
sequence sits in the step (`StepLayout`) is worked out once per step, not once per layer.
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


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Each sequence of a packed step, in the step's order: how many of the step's tokens are its
    queries, how many keys of the context read back are its own, and the causal mask of a chunk of
    more than one query (None for a decode: one query sees every key). Passed to every layer as the
    `step_layout` keyword."""

    queries: list[int]
    keys: list[int]
    masks: tuple[torch.Tensor | None, ...]

    @classmethod
    def of(cls, cu_q: Sequence[int], cu_k: Sequence[int], device: str | torch.device) -> StepLayout:
        """From the cumulative query and key lengths ([sequences + 1] each). Each sequence's queries are
        the last of its keys' positions: the mask is causal aligned to the bottom right."""
        queries = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
        keys = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
        masks = tuple(torch.ones((q, k), dtype=torch.bool, device=device).tril(diagonal=k - q) if q > 1 else None
                      for q, k in zip(queries, keys, strict=True))
        return cls(queries, keys, masks)


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, dim], key and value [1, kv heads, K, dim] (the sequences one after the
    other, as kwarg `step_layout` places them: causal_lm.packed_inputs). Returns [1, T, heads, dim]
    and no weights. Without a layout (a forward without the pool: warm-up, probe) it is
    transformers' sdpa, with sdpa's mask."""
    layout: StepLayout | None = kwargs.get("step_layout")
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    # One split a tensor, not three slicings a sequence: at 32 decoding sequences the views cost
    # about as much as the attention (measured: a layer's attention 1.0-1.2 -> 0.8 ms).
    out = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
           for q, k, v, mask in zip(torch.split(query, layout.queries, dim=2), torch.split(key, layout.keys, dim=2),
                                    torch.split(value, layout.keys, dim=2), layout.masks, strict=True)]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # forwards without the pool: sdpa's mask
