"""Redis losing its data (a restart without persistence, a flush) while requests wait: the
gateway notices its reply stream is gone and fails those requests at once with 503 instead of
letting them run to their deadline; the next requests recreate what is missing and succeed."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers import wait_until
from vramguard.shared.keys import GROUP, Keys


@pytest.mark.slow
async def test_requests_lost_with_redis_data_fail_fast_then_service_resumes(
    redis_client, gateway, start_worker, key_prefix
) -> None:
    await start_worker(models={"synthetic": {"params": {"batch_ms": 1500}}})

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    stream = Keys(key_prefix).request_stream("synthetic")
    started = time.monotonic()
    body = {"inputs": [1], "timeout_ms": 20_000}
    waiting = asyncio.create_task(gateway.post("/v1/models/synthetic/infer", json=body))

    async def in_forward() -> bool:
        return (await redis_client.xpending(stream, GROUP))["pending"] == 1

    await wait_until(in_forward, 5)
    await redis_client.flushdb()  # what a restart of a Redis without persistence looks like
    lost = await waiting
    assert lost.status_code == 503 and "Redis lost the request" in lost.json()["error"]["message"]
    assert time.monotonic() - started < 5  # not its 20 s deadline
    await wait_until(live, 5)  # the worker's heartbeat is back
    again = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [2], "timeout_ms": 10_000})
    assert again.status_code == 200 and again.json()["outputs"] == [2]


async def test_requests_admitted_as_the_loss_is_found_are_not_failed_with_the_lost_ones(
    redis_client, gateway, start_worker
) -> None:
    """The reply stream vanishes while nothing waits; the next requests, admitted together, find it
    missing (one shared check recreates it) and go into the new stream: every one is answered,
    none is failed as lost, also those admitted while the loss is still being described."""
    await start_worker()

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    await redis_client.delete(gateway.app.state.listener.stream)  # what a flush does to it
    responses = await asyncio.gather(*(gateway.post("/v1/models/synthetic/infer", json={"inputs": [i]})
                                       for i in range(8)))
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert [r.json()["outputs"] for r in responses] == [[i] for i in range(8)]
