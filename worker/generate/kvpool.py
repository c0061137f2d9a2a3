"""The worker's KV cache: one pool of fixed-size blocks, allocated once at start, from which every
sequence holds a block table (vLLM's PagedAttention, Kwon et al., SOSP 2023).

The pool is transformers' own: `PagedAttentionCache` (transformers.generation.continuous_batching)
owns the one cache tensor (keys and values of every layer, block by block), hands out blocks
(`can_store_request_tokens`), frees them (`free_blocks`), shares identical prompt prefixes
(`search_prefix_match` / `mark_complete_blocks`: a hash chain over each full block's tokens and its
parent's hash, as vLLM's automatic prefix caching), computes where each token of a step is written
and read (`extend_read_and_write_indices`), and does the write and read inside the model's
attention (`PagedAttentionCache.update`, which every transformers decoder calls). What is not taken
from transformers is its scheduler and request manager (`ContinuousBatchingManager`): it owns its
own request queue, output queue and thread, where a vramguard worker takes requests from the
stream, keeps progress in Redis, resumes after a crash and cancels; kvpool.py is the seam.

The synthetic model on the simulated device uses the same pool on the `meta` device (block
bookkeeping without storage) and takes the pool's bytes from the simulated allocator once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper


@dataclass(slots=True)
class _State:
    """What PagedAttentionCache reads of a request: its id, the tokens in its cache, their ids."""

    request_id: str
    length: int = 0
    initial_tokens: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    status: object = None

    def current_len(self) -> int:
        return self.length


class KVPool:
    """`num_blocks` blocks of `block_tokens` tokens, keys and values of every layer of `config`
    (a transformers PretrainedConfig), on `device` in `dtype`. `prefix_sharing`: identical full
    prompt blocks are held once. Raises ValueError when the blocks do not tile the cache tensor
    (transformers' sectors hold a whole number of blocks)."""

    def __init__(self, config: Any, num_blocks: int, block_tokens: int, device: str, dtype: torch.dtype,
                 prefix_sharing: bool = True, on_close: Callable[[], None] | None = None) -> None:
        cb = ContinuousBatchingConfig(page_size=block_tokens, num_blocks=num_blocks, max_batch_tokens=block_tokens,
                                      allow_block_sharing=prefix_sharing, max_blocks_per_request=0,
                                      max_memory_percent=1.0)
        self.cache = PagedAttentionCache(config, cb, device, DistributedHelper(None, None), dtype=dtype)
        self._allocator = self.cache.cache_allocators["full_attention"]
        if len(self.cache.cache_allocators) != 1 or self._allocator.blocks_per_sector != 1:
            raise ValueError("the KV pool takes full-attention models whose block is a whole number of 128 bytes")
        self.block_tokens = block_tokens
        self.num_blocks = int(self.cache.num_blocks)
        self.bytes = int(self.cache.cache_tensor.numel() * self.cache.cache_tensor.element_size())
        self.prefix_sharing = bool(self.cache.use_prefix_sharing)
        self.prefix_hits = 0  # sequences that found their prompt's first blocks in the pool
        self.prefix_hit_tokens = 0
        self._states: dict[str, _State] = {}
        self._on_close = on_close

    def close(self) -> None:
        """Give the pool's memory back (a probe pool at start; the simulated device's block)."""
        self.release_all()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    # --- counters ------------------------------------------------------------------------------

    def free_blocks(self) -> int:
        """Blocks a sequence can take now: free ones and the unreferenced ones kept for their prefix."""
        pool = self.cache.pool
        return (pool.num_free_sectors + pool.count_free_blocks(self._allocator.index)
                + len(self._allocator.ledger.cached_blocks))

    def held_blocks(self) -> int:
        """Blocks some sequence's table holds (a shared block once)."""
        return self.num_blocks - self.free_blocks()

    def shared_blocks(self) -> int:
        """Blocks held by two sequences or more (prefix sharing)."""
        return len(self._allocator.ledger.shared_ref_counts)

    def table(self, request_id: str) -> list[int]:
        return list(self._allocator.block_table.get(request_id, []))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    # --- a sequence's blocks -------------------------------------------------------------------

    def share_prefix(self, request_id: str, tokens: list[int]) -> int:
        """Give a new sequence the pool's blocks of its longest cached prefix of `tokens` (full blocks,
        never the last token, which must be computed for its logits). Returns the tokens matched."""
        state = self._states.setdefault(request_id, _State(request_id))
        matched = self.cache.search_prefix_match(request_id, tokens) if state.length == 0 else 0
        if matched:
            self.prefix_hits += 1
            self.prefix_hit_tokens += matched
            state.length = matched
        return matched

    def grow(self, request_id: str, tokens: int) -> bool:
        """Make room for `tokens` more tokens after those the sequence holds (blocks from the free
        list, then from unreferenced cached prefixes). False, and nothing taken, when the pool has too few."""
        state = self._states.setdefault(request_id, _State(request_id))
        if self.cache.can_store_request_tokens(state, tokens):  # type: ignore[arg-type]
            return True
        if not self.cache.evict_cached_blocks():
            return False
        self.cache.pool.try_to_free_sectors()
        return self.cache.can_store_request_tokens(state, tokens)  # type: ignore[arg-type]

    def wrote(self, request_id: str, context: list[int], tokens: int) -> None:
        """After a step wrote `tokens` tokens of the sequence whose context (all its tokens in the
        cache now) is `context`: count them, and hash the blocks they completed so later prompts can
        share them."""
        state = self._states[request_id]
        complete = self.cache.count_new_complete_blocks(state, tokens)  # type: ignore[arg-type]
        state.length += tokens
        if complete and self.prefix_sharing:
            state.initial_tokens, state.generated_tokens = context, []
            self.cache.mark_complete_blocks(state, complete)  # type: ignore[arg-type]

    def length(self, request_id: str) -> int:
        state = self._states.get(request_id)
        return 0 if state is None else state.length

    def release(self, request_id: str) -> None:
        """Free the sequence's blocks (a shared one when its last holder goes; a full one stays cached
        for its prefix until the pool needs it)."""
        self._states.pop(request_id, None)
        self.cache.free_blocks(request_id)
        self.cache.pool.try_to_free_sectors()

    def release_all(self) -> None:
        for request_id in list(self._states):
            self.release(request_id)

    def indices(self, request_id: str, past: int, tokens: int, read: list[int], write: list[int]) -> None:
        """Append where `tokens` new tokens after `past` are written, and where the sequence's whole
        context is read back from (flat token slots of the pool)."""
        self.cache.extend_read_and_write_indices(request_id, past, tokens, [read], [write])
