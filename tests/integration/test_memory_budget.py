"""The memory budget with a real redis-server, the in-process gateway and in-process workers on
the simulated device: OOMs split instead of failing, poison inputs get 413, long inputs are not
padded with short ones, and a lost device context stops the worker without acking."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers import wait_until
from vramguard.shared.keys import GROUP, Keys
from vramguard.worker.runner import ExitCode

MIB = 1024 * 1024
# On 64 MiB: (51.2 - 12 outside the allocator - 20 for the 8 MiB weights' segment - 4) / 4 -> 3 items
SMALL = {"weights_mib": 8, "fixed_mib": 4, "item_mib": 4}


async def live(gateway: httpx.AsyncClient, n: int = 1) -> None:
    async def check() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == n

    await wait_until(check, 10)


async def infer(gateway: httpx.AsyncClient, inputs: list[object], **extra: object) -> httpx.Response:
    return await gateway.post("/v1/models/synthetic/infer", json={"inputs": inputs, **extra})


async def test_wrong_budget_ooms_split_and_every_request_succeeds(gateway, start_worker) -> None:
    """1. Planner off, max_batch_size 32 on a device that holds 9 items per forward.
    2. 32 requests arrive in one batch window.
    Result: forwards OOM and are split in halves, all 32 get their output, the adaptive cap went down."""
    handle = await start_worker(device="sim", sim_memory_bytes=64 * MIB, memory_planner=False,
                                models={"synthetic": {"max_batch_size": 32, "max_wait_ms": 200, "params": SMALL}})
    await live(gateway)
    assert (await infer(gateway, [0, 0])).status_code == 200  # opens the batch window
    responses = await asyncio.gather(*(infer(gateway, [i]) for i in range(32)))
    assert [r.status_code for r in responses] == [200] * 32
    assert [r.json()["outputs"] for r in responses] == [[i] for i in range(32)]
    budget = handle.worker.budget
    assert handle.worker.stats.max_batch_seen > 9  # a batch too large for the device was really tried
    assert budget.oom_events >= 1 and budget.batch_splits >= 1
    assert budget.max_batch_size < 32


async def test_poison_input_in_a_batch_of_8_gets_413_and_the_rest_200(gateway, start_worker) -> None:
    """1. A planned budget (16 items) and a batch of 8 requests, one of which needs 1000 MiB.
    Result: that one gets 413 input_too_large, the 7 others 200, the worker keeps serving."""
    handle = await start_worker(device="sim", sim_memory_bytes=128 * MIB, fault_injection=True,
                                models={"synthetic": {"max_wait_ms": 200, "params": SMALL}})
    await live(gateway)
    # (0.8 x 128 - 12 outside the allocator - 20 for the weights' segment - 4 fixed) / 4 = 16.6 -> 16
    assert handle.worker.budget.plan.planned_batch_size == 16
    assert (await infer(gateway, [0, 0])).status_code == 200
    bodies: list[object] = [0, 1, 2, {"alloc_mib": 1000}, 4, 5, 6, 7]
    responses = await asyncio.gather(*(infer(gateway, [b]) for b in bodies))
    assert [r.status_code for r in responses] == [200] * 3 + [413] + [200] * 4
    assert responses[3].json()["error"]["code"] == "input_too_large"
    assert [r.json()["outputs"] for i, r in enumerate(responses) if i != 3] == [[b] for b in (0, 1, 2, 4, 5, 6, 7)]
    assert handle.worker.stats.max_batch_seen == 8  # they really shared one batch
    again = await infer(gateway, [42])
    assert again.status_code == 200 and not handle.task.done()


TEXT = {"weights_mib": 8, "fixed_mib": 4, "item_mib": 0.25, "max_tokens": 64, "batch_ms": 5, "item_ms": 4}


# (0.8 x device - 12 outside the allocator - 20 for the weights' segment - 4) / 0.25 per token
@pytest.mark.parametrize(("device_mib", "max_batch_tokens"), [(128, 265), (256, 675)])
async def test_mixed_lengths_short_inputs_are_not_delayed_by_a_long_one(
    gateway, start_worker, device_mib: int, max_batch_tokens: int
) -> None:
    """1. A text-like model: 4 ms per padded token; a budget of 265 tokens per forward (the
    budget alone keeps the long text apart), or of 675 (8 x 64 padded tokens would fit: the
    padding rule of worker/batch/costing.py must keep it apart).
    2. 7 short texts and 1 at the model's maximum (64 tokens) arrive in one batch window.
    Result: the short ones come back within about 2x a short text's own latency (they would wait
    for 8 x 64 padded tokens otherwise), and no forward went over the budget."""
    handle = await start_worker(device="sim", sim_memory_bytes=device_mib * MIB,
                                models={"synthetic": {"max_wait_ms": 100, "params": TEXT}})
    await live(gateway)
    budget = handle.worker.budget
    assert budget.plan.planned_batch_tokens == max_batch_tokens and budget.plan.max_item_cost == 64

    async def timed(text: str) -> tuple[float, httpx.Response]:
        started = time.monotonic()
        response = await infer(gateway, [text])
        return time.monotonic() - started, response

    singles = []
    for _ in range(3):
        assert (await infer(gateway, ["warm", "up"])).status_code == 200  # the next read opens its window
        elapsed, response = await timed("two words")
        assert response.status_code == 200
        singles.append(elapsed)
    single_s = sorted(singles)[1]
    assert (await infer(gateway, ["warm", "up"])).status_code == 200
    long_text = " ".join(["w"] * 64)
    results = await asyncio.gather(*(timed(t) for t in ["two words"] * 3 + [long_text] + ["two words"] * 4))
    assert all(r.status_code == 200 for _t, r in results)
    short = [t for i, (t, _r) in enumerate(results) if i != 3]
    assert max(short) <= 2 * single_s + 0.05, (short, single_s)
    assert results[3][0] > max(short)  # the long one ran in its own, later forward
    assert budget.oom_events == 0
    assert budget.accounting.peak_bytes() <= budget.limit_bytes


async def test_input_too_large_alone_is_refused_at_once(gateway, start_worker) -> None:
    """1. A budget of 40 tokens per forward ((0.8 x 96 - 12 - 20 - 4) / 1 MiB per token) and a model
    window of 64 tokens.
    Result: a 64-token text gets 413 input_too_large without any forward; a 10-token text 200."""
    handle = await start_worker(device="sim", sim_memory_bytes=96 * MIB,
                                models={"synthetic": {"params": {**TEXT, "item_mib": 1, "item_ms": 70}}})
    await live(gateway)
    budget = handle.worker.budget
    assert budget.plan.planned_batch_tokens == 40
    forwards = handle.worker.stats.forwards
    refused = await infer(gateway, [" ".join(["w"] * 64)])
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "input_too_large"
    assert handle.worker.stats.forwards == forwards and budget.oom_events == 0
    ok = await infer(gateway, [" ".join(["w"] * 10)])
    assert ok.status_code == 200


async def test_oom_that_persists_exits_without_acking(gateway, start_worker, redis_client, key_prefix) -> None:
    """1. An input leaks all free device memory; the next batch OOMs even for one item, and so
    does the one-item probe.
    Result: the worker returns ExitCode.CUDA_CONTEXT_LOST and its entry stays pending (un-acked)."""
    handle = await start_worker(device="sim", sim_memory_bytes=64 * MIB, fault_injection=True,
                                models={"synthetic": {"params": SMALL}})
    await live(gateway)
    assert (await infer(gateway, [{"fault": "leak"}])).status_code == 200
    request = asyncio.create_task(infer(gateway, [1], timeout_ms=3000))
    assert await asyncio.wait_for(handle.task, 20) == ExitCode.CUDA_CONTEXT_LOST
    pending = await redis_client.xpending(Keys(key_prefix).request_stream("synthetic"), GROUP)
    assert pending["pending"] == 1
    assert (await request).status_code in (503, 504)


async def test_a_lost_context_stops_the_concurrent_forward_from_publishing(
    gateway, start_worker, redis_client, key_prefix
) -> None:
    """1. Two forwards in flight (max_inflight_batches=2): a slow one of 20 items (1.2 s), then,
       once it runs, a one-item batch whose forward hits a CUDA error after 60 ms.
    Result: the worker exits CUDA_CONTEXT_LOST; the slow forward, finishing on a device no longer
    trusted, publishes nothing: its request is not answered by the worker (504 at its deadline)
    and both entries stay pending, un-acked, for a fresh process to reclaim."""
    handle = await start_worker(device="sim", fault_injection=True, models={"synthetic": {
        "max_inflight_batches": 2, "max_wait_ms": 1, "params": {**SMALL, "batch_ms": 0, "item_ms": 60}}})
    await live(gateway)
    assert handle.worker.budget.plan.inflight_batches == 2
    slow = asyncio.create_task(infer(gateway, list(range(20)), timeout_ms=3000))
    # Running now, not merely admitted once: the warm-up forward already counts in
    # max_concurrent_forwards, and two requests sent in one loop pass share one batch.
    await wait_until(lambda: handle.worker.budget.running_forwards >= 1, 5, interval_s=0.005)
    broken = asyncio.create_task(infer(gateway, [{"fault": "cuda_error"}], timeout_ms=3000))
    assert await asyncio.wait_for(handle.task, 20) == ExitCode.CUDA_CONTEXT_LOST
    assert handle.worker.budget.max_concurrent_forwards == 2  # the two forwards did overlap
    assert (await slow).status_code == 504 and (await broken).status_code == 504
    pending = await redis_client.xpending(Keys(key_prefix).request_stream("synthetic"), GROUP)
    assert pending["pending"] == 2
