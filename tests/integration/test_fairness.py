"""Fairness under mixed load: a request larger than a batch is served in slices, so a 1-input
request that arrives while bulk requests are in progress rides in the next forward instead of
waiting for all of theirs; the bulk replies come back whole, in item order, with the same
per-item error behaviour as an unsplit request. Counted in forwards, not seconds, so that the
verdict does not depend on the machine's speed."""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers import wait_until

BATCH = 8  # max_batch_size: a 64-input request takes 8 forwards


async def start(gateway: httpx.AsyncClient, start_worker, batch_ms: float = 50, **extra: object):  # type: ignore[no-untyped-def]
    # Every forward sleeps batch_ms whatever its size, so a forward is a forward on any machine.
    handle = await start_worker(model="synthetic", models={"synthetic": {
        "max_batch_size": BATCH, "max_wait_ms": 5, "params": {"batch_ms": batch_ms, "item_ms": 0}}}, **extra)

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    return handle


def infer(gateway: httpx.AsyncClient, inputs: list[object]) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(gateway.post("/v1/models/synthetic/infer", json={"inputs": inputs}))


async def test_a_small_request_rides_in_the_next_forward_while_bulk_ones_run(gateway, start_worker) -> None:
    handle = await start(gateway, start_worker)
    stats = handle.worker.stats
    bulk = [infer(gateway, [f"b{k}-{i}" for i in range(8 * BATCH)]) for k in range(3)]  # 24 forwards of work
    await wait_until(lambda: stats.forwards >= 1, 10)  # bulk work is in progress
    admitted_at = stats.forwards
    small = await gateway.post("/v1/models/synthetic/infer", json={"inputs": ["small"]})
    answered_at = stats.forwards

    assert small.status_code == 200 and small.json()["outputs"] == ["small"]
    # The forward running when it arrived, then its own (one more may finish before we look).
    assert answered_at - admitted_at <= 3, (admitted_at, answered_at)
    assert not all(task.done() for task in bulk)  # it overtook bulk work already read
    replies = await asyncio.gather(*bulk)
    assert [r.json()["outputs"] for r in replies] == [[f"b{k}-{i}" for i in range(8 * BATCH)] for k in range(3)]


async def test_a_sliced_request_is_reassembled_in_order(gateway, start_worker) -> None:
    await start(gateway, start_worker)
    odd = [f"odd{i}" for i in range(3 * BATCH + 5)]  # not a multiple of the batch size
    big, smalls = infer(gateway, odd), [infer(gateway, [f"s{i}"]) for i in range(5)]
    assert (await big).json()["outputs"] == odd
    assert [(await s).json()["outputs"] for s in smalls] == [[f"s{i}"] for i in range(5)]


async def test_a_failing_item_of_a_sliced_request_fails_that_request_alone(gateway, start_worker) -> None:
    await start(gateway, start_worker, fault_injection=True)
    bad = [f"x{i}" for i in range(2 * BATCH + 3)]
    bad[BATCH + 1] = {"fault": "raise"}  # in the second slice
    failing, good = infer(gateway, bad), infer(gateway, [f"g{i}" for i in range(2 * BATCH + 3)])
    small = infer(gateway, ["small"])
    failed = await failing
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_error"
    assert "injected fault" in failed.json()["error"]["message"]
    assert (await good).json()["outputs"] == [f"g{i}" for i in range(2 * BATCH + 3)]
    assert (await small).json()["outputs"] == ["small"]


async def test_a_sliced_request_past_its_deadline_is_answered_504_and_costs_no_more_forwards(
        gateway, start_worker) -> None:
    handle = await start(gateway, start_worker)
    stats = handle.worker.stats
    before = stats.forwards
    # 8 forwards of 50 ms of work; the deadline passes after about 3 of them.
    late = await gateway.post("/v1/models/synthetic/infer",
                              json={"inputs": list(range(8 * BATCH)), "timeout_ms": 150})
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
    await wait_until(lambda: stats.expired == 1, 5)  # the worker's own 504: acked, dropped
    spent = stats.forwards - before
    await asyncio.sleep(0.3)  # time for the rest of its slices, had they run
    assert stats.forwards - before == spent < 8
    after = await gateway.post("/v1/models/synthetic/infer", json={"inputs": ["next"]})
    assert after.json()["outputs"] == ["next"]


async def test_requests_held_over_many_forwards_are_not_reclaimed(gateway, start_worker) -> None:
    # Two requests of 8 forwards of 150 ms each: the second waits in the batcher while the first
    # is served, pending for longer than claim_idle_ms without being in any batch.
    handle = await start(gateway, start_worker, batch_ms=150, reclaim_interval_ms=100, claim_idle_ms=700)
    bodies = [{"inputs": [f"{k}-{i}" for i in range(8 * BATCH)]} for k in range(2)]
    replies = await asyncio.gather(*(gateway.post("/v1/models/synthetic/infer", json=b) for b in bodies))
    assert [r.json()["outputs"] for r in replies] == [b["inputs"] for b in bodies]
    assert handle.worker.reclaimer.claimed == 0  # nothing looked abandoned, nothing ran twice


async def test_a_drain_finishes_a_request_it_has_started_slicing(gateway, start_worker) -> None:
    handle = await start(gateway, start_worker)
    bulk = infer(gateway, [f"d{i}" for i in range(8 * BATCH)])
    await wait_until(lambda: handle.worker.stats.forwards >= 2, 10)  # partly served
    assert await handle.stop() == 0  # drained: the rest of its slices ran before the exit
    assert (await bulk).json()["outputs"] == [f"d{i}" for i in range(8 * BATCH)]
