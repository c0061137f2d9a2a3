"""The KV plan of a starting generative worker, from what it measures: the memory plan's budget,
context and weights (worker/memory/budget.py), then, in a small probe pool, a step's time per token
(the token budget) and a step's activation peak with a cache present (what each cached token the
step reads adds to it), then the pool itself, allocated once. The arithmetic is kvplan.py's. Three
probe steps, a few hundred tokens: SmolLM2-135M computes one in 2-8 ms on a CPU core.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from vramguard.worker.generate.engine import Chunk
from vramguard.worker.generate.kvplan import (
    CPU_POOL_BYTES,
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_STEP_TARGET_MS,
    TRASH_BLOCKS,
    KVPlan,
    KVPlanError,
    plan_kv,
    size_token_budget,
)
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.sequence import Sequence
from vramguard.worker.memory.accounting import MemoryAccounting
from vramguard.worker.memory.budget import MemoryBudget
from vramguard.worker.memory.plan import Fit

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Probe:
    """A stand-in sequence for the probe steps (the pool and the backends read its request_id)."""

    request_id: str


def _probe_step(backend: Any, pool: KVPool, request_id: str, tokens: int) -> float:
    """Run `tokens` more tokens of probe sequence `request_id` as one step; returns its seconds."""
    past = pool.length(request_id)
    if not pool.grow(request_id, tokens):
        raise RuntimeError("the probe pool is too small for its own steps")
    chunk = Chunk(cast(Sequence, _Probe(request_id)), past, [1] * tokens, True)
    started = time.perf_counter()
    backend.forward_step(pool, [chunk])
    elapsed = time.perf_counter() - started
    pool.wrote(request_id, [1] * (past + tokens), tokens)
    return elapsed


def _fitting_step(backend: Any, pool: KVPool, tokens: int,
                  accounting: MemoryAccounting | None) -> tuple[float, int] | None:
    """A probe step of `tokens` tokens on a fresh "context" sequence: its seconds and peak, or None
    when it ran out of memory (the exception does not outlive the except block: PyTorch FAQ)."""
    import torch

    pool.release("context")
    try:
        return _measured(backend, pool, "context", tokens, accounting)
    except torch.cuda.OutOfMemoryError:
        pass
    return None


def _measured(backend: Any, pool: KVPool, request_id: str, tokens: int,
              accounting: MemoryAccounting | None) -> tuple[float, int]:
    """A probe step's seconds and the bytes it added at its peak over what was allocated before it
    (reset_peak_memory_stats, then max_memory_allocated, as worker/memory/budget.py measures
    forwards; 0 without accounting)."""
    if accounting is None:
        return _probe_step(backend, pool, request_id, tokens), 0
    accounting.empty_cache()
    before = accounting.allocated_bytes()
    accounting.reset_peak()
    seconds = _probe_step(backend, pool, request_id, tokens)
    return seconds, max(0, accounting.peak_bytes() - before)


def measure_steps(backend: Any, pool: KVPool, accounting: MemoryAccounting | None, params: Mapping[str, object],
                  max_running: int) -> tuple[int, int, int]:
    """Three probe steps in `pool`: one block's tokens (twice, timed), max_step_tokens (timed; halved
    while it runs out of memory), and the token budget over the cache the second left (a step's
    reads). The budget is params' token_budget, else sized from the first two's times
    (kvplan.size_token_budget). Returns (token_budget, step_fixed_bytes: the peak at the budget over
    no cache, between the first two's, read_bytes_per_token: what each cached token the third read
    added); no peaks (0) without accounting."""
    highest, block = int(backend.max_item_cost), pool.block_tokens
    small, small_peak = min(_measured(backend, pool, "small", block, accounting) for _ in range(2))
    pool.release("small")
    while (big := _fitting_step(backend, pool, highest, accounting)) is None and highest > block:
        highest //= 2  # a step this long ran out of memory: the budget stays below it
    if big is None:
        raise KVPlanError(f"a step of {highest} tokens runs out of memory next to the probe pool")
    per_token_ms = 1000 * (big[0] - small) / max(1, highest - block)
    if "token_budget" in params:
        budget = max(1, int(cast(int, params["token_budget"])))
    else:
        budget = size_token_budget(fixed_ms=1000 * small - per_token_ms * block, ms_per_token=per_token_ms,
                                   target_ms=float(cast(float, params.get("step_target_ms", DEFAULT_STEP_TARGET_MS))),
                                   rows=max_running, lowest=min(highest, max_running + block), highest=highest)
    if accounting is None:
        return budget, 0, 0
    fixed = small_peak + (big[1] - small_peak) * max(0, budget - block) // max(1, highest - block)
    _seconds, with_cache = _measured(backend, pool, "context", budget, accounting)  # reads the big step's tokens
    return budget, fixed, max(0, (with_cache - fixed) // highest)


def build_kv_plan(backend: Any, budget: MemoryBudget, max_running: int,
                  params: Mapping[str, object]) -> tuple[KVPlan, KVPool]:
    """The KV plan and its pool, allocated once, from the worker's measured memory plan and the
    probe steps (measure_steps). Raises KVPlanError; logs a warning when the bytes per token the
    pool's tensor takes differ from the model config's."""
    plan = budget.plan
    block = int(cast(int, params.get("block_tokens", DEFAULT_BLOCK_TOKENS)))
    highest = int(backend.max_item_cost)
    probe = backend.new_pool(2 * (-(-highest // block)) + 2, block)
    try:
        measured = probe.bytes // ((probe.num_blocks + TRASH_BLOCKS) * block)
        token_budget, fixed, read = measure_steps(backend, probe, budget.accounting if plan.planned else None,
                                                  params, max_running)
    finally:
        probe.close()
    expected = int(backend.kv_bytes_per_token)
    if measured != expected:
        log.warning("KV cache bytes per token measured differ from the model config's",
                    extra={"measured": measured, "config": expected})
    on_cpu = budget.accounting.kind == "cpu"
    context = 0 if on_cpu else plan.context_bytes
    fitted = Fit(plan.fixed_bytes, plan.per_unit_bytes).predict(token_budget) if plan.planned else 0
    pool_tokens = params.get("pool_tokens", CPU_POOL_BYTES // max(expected, measured) if on_cpu else None)
    # What stays reserved between steps (cuBLAS's workspace beside the weights) is held as the weights are
    held = max(plan.weights_bytes, plan.resting_bytes)
    kv = plan_kv(budget_bytes=plan.budget_bytes, context_bytes=context, weights_bytes=held,
                 step_fixed_bytes=max(fixed, fitted), read_bytes_per_token=read,
                 bytes_per_token=max(expected, measured), measured_bytes_per_token=measured, block_tokens=block,
                 token_budget=token_budget, max_running=max_running, context_window=backend.context_window,
                 pool_tokens=int(cast(int, pool_tokens)) if pool_tokens is not None else None)
    return kv, backend.new_pool(kv.num_blocks, block, prefix_sharing=bool(params.get("prefix_sharing", True)))
