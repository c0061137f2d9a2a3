"""The KV pool holds under the caching allocator's rules without an allowance for holes: random mixed
generation workloads (bench/kv_fragmentation.py: prompts of 1-60 tokens, 1-300 new tokens, bursty
arrivals) on small simulated GPUs never run out of memory inside the plan, and preempt when the
pool is full instead."""

from __future__ import annotations

import pytest

from bench.kv_fragmentation import run, start

SHAPES = [(256, 64, 30), (512, 64, 16)]  # device MiB, KV KiB per token, layers


@pytest.mark.parametrize(("device_mib", "kv_kib", "layers"), SHAPES)
@pytest.mark.slow
def test_mixed_workloads_fit_the_pool_without_an_allowance_for_holes(device_mib: int, kv_kib: int,
                                                                      layers: int) -> None:
    outcome = run(device_mib, kv_kib, layers, workloads=4)
    assert outcome.oom_workloads == 0, outcome
    assert outcome.preemptions > 0, outcome  # the workloads filled the pool: it preempted, not allocated


def test_the_pool_is_one_allocation_inside_the_plan() -> None:
    backend, plan, pool = start(256, 64, 8)
    sim = backend._sim
    assert sim is not None
    assert pool.bytes == plan.pool_bytes == (plan.num_blocks + 2) * plan.block_tokens * plan.bytes_per_token
    assert plan.context_bytes + plan.weights_bytes + plan.step_peak_bytes + plan.pool_bytes <= plan.budget_bytes
    held = sim.memory_allocated()
    pool.close()  # the pool's one block goes back: nothing else was allocated for the cache
    assert held - sim.memory_allocated() >= plan.pool_bytes
