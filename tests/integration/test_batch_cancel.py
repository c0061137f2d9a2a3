"""A batch model's request whose client left before its batch ran is not computed: the gateway
marks it cancelled on disconnect (its cancel key), the worker reads the marks of a batch's
requests in one command before the forward and acks the cancelled ones without computing them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis

from tests.helpers import Stack, wait_until
from vramguard.shared.keys import Keys

INFER = "/v1/models/synthetic/infer"


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_request_whose_client_left_before_its_batch_is_not_computed(stack: Stack, key_prefix: str) -> None:
    """1. A synthetic worker that sleeps 100 ms per input and runs one batch at a time; request A
    of 40 inputs (4 s) is being computed.
    2. Request B of 64 inputs is queued behind it; its HTTP client closes before A's batch ends.
    Result: B's cancel key is set while A still runs; the worker counts B cancelled, and its items
    and requests count A's only (B's 64 inputs were never computed)."""
    params = json.dumps({"item_ms": 100.0, "batch_ms": 0.0})
    common = {"served_models": "synthetic", "model": "synthetic", "memory_planner": "false",
              "models__synthetic__params": params, "models__synthetic__max_wait_ms": 1.0}
    stack.start_gateway(**common)
    stack.start_worker(**common)
    await stack.wait_ready()
    keys = Keys(key_prefix)
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            a = asyncio.create_task(client.post(INFER, json={"inputs": list(range(40))}))

            async def pending(n: int) -> bool:
                info = await redis.xpending(keys.request_stream("synthetic"), "workers")
                return int(info["pending"]) >= n

            await wait_until(lambda: pending(1), 60)  # A's batch was read: B cannot join it
            async with httpx.AsyncClient(base_url=stack.url, timeout=120) as other:
                b = asyncio.create_task(other.post(INFER, json={"inputs": list(range(64))}))

                async def queued() -> bool:
                    info = await redis.xinfo_stream(keys.request_stream("synthetic"))
                    return int(info["entries-added"]) >= 2

                await wait_until(queued, 30)
                b.cancel()  # the client leaves: httpx drops its connection
                with pytest.raises(asyncio.CancelledError):
                    await b

            async def marked() -> bool:
                return bool(await redis.keys(keys.cancel("synthetic", "*")))

            await wait_until(marked, 30)
            assert not a.done(), "A's batch ended before B's cancel mark was set: the scenario did not happen"
            assert (await a).status_code == 200

            async def beat() -> dict[str, object]:
                workers = (await client.get("/v1/models/synthetic")).json()["workers"]
                return next(iter(workers.values()))  # type: ignore[no-any-return]

            async def counted() -> bool:
                return (await beat()).get("cancelled") == 1

            await wait_until(counted, 30)
            worker = await beat()
        assert worker["items"] == 40 and worker["requests"] == 1, worker
        assert int((await redis.xpending(keys.request_stream("synthetic"), "workers"))["pending"]) == 0
    finally:
        await redis.aclose()
