"""The KV-cache plan's arithmetic (docs/concepts/architecture.md "Memory"): what is left of the worker's budget
after its context, weights and the activation peak of one step is the KV cache; a sequence is
admitted to the running batch only when the cache can hold every running sequence at its
largest (prompt + max_tokens), as the running batch lays it out (kvbatch.py: rows x the longest
row). So a sequence that started always finishes: nothing is preempted, and a full cache makes
requests wait in the stream. The budget is for reserved memory, which the cap binds, so the plan
also sets aside the holes the cache's tensors leave in the caching allocator's segments
(`fragmentation_bytes`). Pure numbers: no torch, no Redis.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from vramguard.worker.memory.simalloc import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    round_size,
    segment_size,
)


class KVPlanError(RuntimeError):
    """The budget leaves no room for one sequence of one token after weights and the step's peak."""


@dataclass(frozen=True, slots=True)
class KVPlan:
    """bytes_per_token: one token of one sequence in the cache (model config, checked against a
    measured prefill); kv_budget_bytes = budget - context - weights - step_peak_bytes (the
    predicted peak of one step: a prefill chunk plus a decode token per running row) -
    fragmentation_bytes (the room left for the caching allocator's holes beside the cache's tensors,
    `holes_beside`, at the size where they bind);
    copy_fraction: the share of the cache that exists twice while it changes (a join, a leave and
    every decode step copy a DynamicCache's tensors one layer at a time: torch.cat / index_select
    hold a layer's old and new tensors at once, two layers' worth at most, so 2 / layers);
    tokens_fit = kv_budget_bytes // (bytes_per_token x (1 + copy_fraction)); max_running: the
    configured cap on rows."""

    bytes_per_token: int
    measured_bytes_per_token: int
    budget_bytes: int
    context_bytes: int
    weights_bytes: int
    step_peak_bytes: int
    kv_budget_bytes: int
    tokens_fit: int
    max_running: int
    prefill_chunk_tokens: int
    context_window: int
    copy_fraction: float = 0.0
    fragmentation_bytes: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def admits(self, reserved: Iterable[int], new: int) -> bool:
        """Whether the running sequences (each `reserved` tokens at most) and one more of `new`
        tokens fit, laid out as rows x the longest row, within max_running rows."""
        rows = [*reserved, new]
        return len(rows) <= self.max_running and len(rows) * max(rows) <= self.tokens_fit

    def reserved_bytes(self, reserved: Iterable[int]) -> int:
        """The cache the running sequences may grow to (rows x longest row x bytes per token)."""
        rows = list(reserved)
        return len(rows) * max(rows, default=0) * self.bytes_per_token


def holes_beside(tensor_bytes: int, tensors: int) -> int:
    """Reserved bytes the CUDA caching allocator may hold, unusable, beside `tensors` live tensors of
    `tensor_bytes` each that are made again at a new size over and over, as a DynamicCache's per-layer
    keys and values are by torch.cat at every decode step, join and leave.

    From the allocator's rules (c10/cuda/CUDACachingAllocator.cpp, as worker/memory/simalloc.py keeps them):
    tensors under kMinLargeAlloc (10 MiB) share segments of `segment_size` (2 MiB in the small pool,
    20 MiB in the large one), seg // size to a segment, and the cap counts every segment whole, the
    last one's empty slots and each one's remainder included. From 10 MiB up a tensor is alone in its
    segment: a new one is rounded up to kRoundLarge (2 MiB), but best fit may also place it in a 20 MiB
    segment that smaller tensors left cached, and the rest of that segment is then split off, too
    small to use. Besides that, we take each segment to hold at most one free hole smaller than a
    tensor (the old copy of one that grew, since best fit hands out any free block at least as large
    as the request and freed neighbours merge): not a rule of the allocator, but what
    `python -m bench.kv_fragmentation` found to hold over its 24 shapes. Expandable segments
    (PYTORCH_CUDA_ALLOC_CONF) are not modelled here.
    """
    if tensor_bytes <= 0 or tensors <= 0:
        return 0
    size = round_size(tensor_bytes)
    segment = segment_size(size)
    if size < MIN_LARGE_ALLOC:
        segments = math.ceil(tensors / (segment // size))  # at least 2 to a segment: it is twice its largest request
        return segments * (segment + size) - tensors * size
    alone = max(segment, LARGE_BUFFER) if size <= LARGE_BUFFER else segment
    return tensors * (alone - size)


def _piece_ends(largest: int) -> list[int]:
    """The tensor sizes (bytes, up to `largest`) where `holes_beside` jumps, and the size just
    before each: between two of them it is linear in the size, so its most over any range of sizes
    is at one of these or at the range's end."""
    jumps = {SMALL_SIZE + MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, LARGE_BUFFER + MIN_BLOCK_SIZE}
    # Tensors per segment drop below k past segment / k; the large pool holds requests over 1 MiB only.
    for segment, smallest in ((SMALL_BUFFER, MIN_BLOCK_SIZE), (LARGE_BUFFER, SMALL_SIZE)):
        jumps.update(MIN_BLOCK_SIZE * (segment // k // MIN_BLOCK_SIZE + 1) for k in range(2, segment // smallest + 1))
    jumps.update(range(MIN_LARGE_ALLOC + MIN_BLOCK_SIZE, largest + 1, ROUND_LARGE))  # past each 2 MiB rounding
    return sorted(size for jump in jumps for size in (jump - MIN_BLOCK_SIZE, jump) if 0 < size <= largest)


def plan_kv(*, budget_bytes: int, context_bytes: int, weights_bytes: int, step_peak_bytes: int,
            bytes_per_token: int, measured_bytes_per_token: int, max_running: int, prefill_chunk_tokens: int,
            context_window: int, copy_fraction: float = 0.0, cache_tensors: int = 0) -> KVPlan:
    """The plan for one worker (all bytes). `cache_tensors`: the tensors the cache is made of (keys
    and values of every layer; 0 plans bytes alone). The cache of T tokens takes T x bytes_per_token
    x (1 + copy_fraction), in tensors of T x bytes_per_token / cache_tensors bytes, and the
    allocator's holes beside them and their copies in flight (`holes_beside`); tokens_fit is
    the largest T for which that fits the room left at every size the cache passes through on its
    way to T (the holes are not monotonic in the size). Raises KVPlanError when no token fits."""
    room = budget_bytes - context_bytes - weights_bytes - step_peak_bytes
    per_token = bytes_per_token * (1 + copy_fraction)
    tokens = int(room // per_token) if bytes_per_token > 0 and room > 0 else 0
    fragmentation = 0
    if cache_tensors > 0 and tokens > 0:
        tokens = _tokens_with_holes(room, bytes_per_token, copy_fraction, cache_tensors, tokens)
        fragmentation = int(room - tokens * per_token)  # rounded down, so kv_budget // per_token is tokens
    kv_budget = room - fragmentation
    if tokens < 1:
        raise KVPlanError(
            f"the memory budget {budget_bytes / 2**20:.1f} MiB holds context {context_bytes / 2**20:.1f} + weights "
            f"{weights_bytes / 2**20:.1f} + one step {step_peak_bytes / 2**20:.1f} MiB and no KV cache next to the "
            f"caching allocator's holes")
    return KVPlan(bytes_per_token=bytes_per_token, measured_bytes_per_token=measured_bytes_per_token,
                  budget_bytes=budget_bytes, context_bytes=context_bytes, weights_bytes=weights_bytes,
                  step_peak_bytes=step_peak_bytes, kv_budget_bytes=kv_budget, tokens_fit=int(tokens),
                  max_running=max_running, prefill_chunk_tokens=prefill_chunk_tokens, context_window=context_window,
                  copy_fraction=copy_fraction, fragmentation_bytes=fragmentation)


def _tokens_with_holes(room: int, bytes_per_token: int, copy_fraction: float, tensors: int, most: int) -> int:
    """The largest T <= `most` whose cache, with its holes, fits `room` at every size up to T's (plan_kv)."""
    in_flight = tensors + math.ceil(copy_fraction * tensors)  # the cache's tensors and the copies being made

    def footprint(size: int) -> float:  # the cache with its tensors at `size` bytes each, copies and holes
        return round_size(size) * tensors * (1 + copy_fraction) + holes_beside(size, in_flight)

    def size_of(tokens: int) -> int:
        return tokens * bytes_per_token // tensors

    ends = _piece_ends(size_of(most))
    running, highest = 0.0, []  # the most footprint over the piece ends so far
    for end in ends:
        running = max(running, footprint(end))
        highest.append(running)

    def fits(tokens: int) -> bool:
        size = size_of(tokens)
        before = bisect.bisect_right(ends, size)
        return footprint(size) <= room and (before == 0 or highest[before - 1] <= room)

    low, high = 0, most  # fits() only turns false as T grows: a running maximum
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
