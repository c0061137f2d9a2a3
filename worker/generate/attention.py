"""Attention for a packed step (worker/generate/causal_lm.py): each sequence's queries against its own
keys and values, through torch's scaled_dot_product_attention, one call per sequence.

Why not transformers' `sdpa` over the packed row with its block-diagonal mask (what its continuous
batching does without flash attention): that computes every query against every key of the step and
masks the rest, T x K scores for T step tokens and K cached tokens read, so 32 decoding sequences of
300 tokens cost 32 x 9,600 scores a head where their own attention is 32 x 300; on a CPU that was
most of a step. Per sequence, the work is each sequence's own, and a sequence's attention does not
depend on what else is in the step. No kernel of ours: the arithmetic is torch's SDPA.

Registered with transformers' AttentionInterface as ATTENTION; PagedAttentionCache.update has
already written the step's keys and values and read each sequence's whole context back (in
`cu_seq_lens_k` order) before this runs, and with that cache the model builds no mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "vramguard_packed_sdpa"


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, dim], key and value [1, kv heads, K, dim] (the sequences one after the
    other: kwargs cu_seq_lens_q and cu_seq_lens_k, int32 [sequences + 1]). Returns [1, T, heads, dim]
    and no weights. Each sequence's queries are the last of its keys' positions: a causal mask
    aligned to the bottom right (a decode, one query, sees every key). Without cu_seq_lens_q (a
    forward without the pool: warm-up, probe) it is transformers' sdpa, with sdpa's mask."""
    if "cu_seq_lens_q" not in kwargs:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    cu_q = kwargs["cu_seq_lens_q"].tolist()
    cu_k = kwargs["cu_seq_lens_k"].tolist()
    gqa = query.shape[1] != key.shape[1]
    out = []
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
        q, k, v = query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]
        mask = None
        if q1 - q0 > 1:  # bottom-right causal: query i sees keys up to past + i
            past = (k1 - k0) - (q1 - q0)
            mask = torch.ones((q1 - q0, k1 - k0), dtype=torch.bool, device=q.device).tril(diagonal=past)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # forwards without the pool: sdpa's mask
