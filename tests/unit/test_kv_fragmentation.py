"""The KV plan holds under the caching allocator's fragmentation: random mixed generation workloads
(bench/kv_fragmentation.py: prompts of 1-60 tokens, 1-300 new tokens, bursty arrivals) on small
simulated GPUs never run out of memory inside the plan, where a plan of bytes alone does."""

from __future__ import annotations

import pytest

from bench.kv_fragmentation import run
from vramguard.worker.generate.kvplan import holes_beside, plan_kv

MIB = 1024 * 1024
SHAPES = [(256, 64, 30), (512, 64, 16)]  # device MiB, KV KiB per token, layers


@pytest.mark.parametrize(("device_mib", "kv_kib", "layers"), SHAPES)
@pytest.mark.slow
def test_mixed_workloads_fit_the_plan_with_its_allowance_for_holes(device_mib: int, kv_kib: int, layers: int) -> None:
    planned = run(device_mib, kv_kib, layers, workloads=4)
    assert planned.oom_workloads == 0, planned
    bytes_alone = run(device_mib, kv_kib, layers, workloads=4, allowance=False)
    assert bytes_alone.oom_workloads > 0, bytes_alone  # the same workloads: the holes are real
    assert planned.tokens_fit < bytes_alone.tokens_fit


def test_holes_follow_the_allocators_segment_rules() -> None:
    # Two 8 MiB tensors share a 20 MiB segment: 4 MiB left over, and one 8 MiB hole at most.
    assert holes_beside(8 * MIB, 2) == 20 * MIB - 2 * 8 * MIB + 8 * MIB
    # A third needs a second segment, reserved whole: 12 MiB empty there, and its own hole.
    assert holes_beside(8 * MIB, 3) == 2 * 20 * MIB - 3 * 8 * MIB + 2 * 8 * MIB
    # 11 MiB is alone in a segment; the worst is a 20 MiB one that smaller tensors left cached.
    assert holes_beside(11 * MIB, 3) == 3 * (20 * MIB - 11 * MIB)
    # Past 20 MiB a tensor's own segment is rounded up to 2 MiB.
    assert holes_beside(41 * MIB, 2) == 2 * (42 * MIB - 41 * MIB)
    assert holes_beside(0, 8) == holes_beside(MIB, 0) == 0


def test_a_room_under_one_large_segment_keeps_the_cache_in_the_small_pool() -> None:
    # 16 MiB of room: any tensor over 1 MiB takes a 20 MiB segment, which the cap cannot hold.
    plan = plan_kv(budget_bytes=16 * MIB, context_bytes=0, weights_bytes=0, step_peak_bytes=0,
                   bytes_per_token=16 * 1024, measured_bytes_per_token=16 * 1024, max_running=64,
                   prefill_chunk_tokens=64, context_window=4096, copy_fraction=0.25, cache_tensors=8)
    assert 0 < plan.tokens_fit * plan.bytes_per_token // 8 <= MIB
    assert plan.kv_budget_bytes + plan.fragmentation_bytes == 16 * MIB
    assert plan.kv_budget_bytes // (plan.bytes_per_token * 1.25) == plan.tokens_fit
