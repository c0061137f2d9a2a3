"""Scenario 4: deadlines shorter than the queue delay.

1. One worker whose forwards take 3 s (batches of up to 128 items). A first request starts a
   forward; while it runs, 200 requests with timeout_ms=400 queue up behind it.
2. Then 200 requests with the default deadline.

Result: the 200 short ones all get 504 deadline_exceeded from the gateway at their deadline
(its own message, not the worker's; none later than 400 ms plus twice the slowest of 200
concurrent immediate answers measured first on this machine); the worker drops them unrun when
it reaches them (its `expired` counter grows by 200, its `forwards` by the first request's only,
and the execution log has none of them); its late deadline_exceeded replies are discarded by
the gateway. The next 200 all get 200, each run once.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.chaos.load import Load, slowest_immediate_answer_s
from tests.helpers import wait_until
from vramguard.shared.keys import Keys
from vramguard.worker.batch.execlog import read_executions

SHORT_MS = 400
GATEWAY_504 = "no reply within"  # the gateway's own 504 message (gateway/admission/dispatch.py)




async def worker_counters(url: str) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=url) as client:
        (beat,) = (await client.get("/v1/models/synthetic")).json()["workers"].values()
    return {k: int(beat[k]) for k in ("forwards", "expired", "requests")}


async def test_expired_requests_get_504_and_cost_no_forward(chaos_stack, chaos_redis) -> None:
    redis = chaos_redis
    chaos_stack.settings.update({"models__synthetic__max_batch_size": 128,
                                 "models__synthetic__params": '{"batch_ms": 3000}'})
    chaos_stack.start_gateway()
    chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    before = await worker_counters(chaos_stack.url)
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=201) as load:
        overhead_s = await slowest_immediate_answer_s(load, 200)
        slack_s = 2 * overhead_s + 0.25
        executions = Keys(chaos_stack.settings["key_prefix"]).executions("synthetic")
        recorded = await redis.hlen(executions)

        async def taken() -> bool:  # recorded just before its forward: the blocker's batch is closed
            return bool(await redis.hlen(executions) > recorded)

        blocker = asyncio.ensure_future(load.request())
        await wait_until(taken, 10, interval_s=0.01)  # the worker has taken it: a 3 s forward is running
        short = await asyncio.gather(*(load.request(timeout_ms=SHORT_MS) for _ in range(200)))
        assert (await blocker).status == 200
        normal = await asyncio.gather(*(load.request() for _ in range(200)))
    load.tally.report("4 deadlines shorter than the queue delay", time.monotonic() - started,
                      slowest_504_ms=round(max(r.latency_s for r in short) * 1000),
                      limit_ms=round((SHORT_MS / 1000 + slack_s) * 1000))
    load.tally.assert_each_answered_with_its_own()
    assert [(r.status, r.code) for r in short] == [(504, "deadline_exceeded")] * 200, {r.message for r in short}
    assert all(GATEWAY_504 in (r.message or "") for r in short), {r.message for r in short}
    assert max(r.latency_s for r in short) < SHORT_MS / 1000 + slack_s
    assert [r.status for r in normal] == [200] * 200

    async def counted() -> bool:
        now = await worker_counters(chaos_stack.url)
        return now["requests"] - before["requests"] >= 201 and now["expired"] - before["expired"] >= 200

    await wait_until(counted, 5)
    after = await worker_counters(chaos_stack.url)
    assert after["expired"] - before["expired"] == 200
    # forwards: 1 for the blocker + the normal ones' batches (<= 128 each), none for the expired
    assert after["forwards"] - before["forwards"] <= 1 + 4
    runs = read_executions(await redis.hkeys(Keys(chaos_stack.settings["key_prefix"]).executions("synthetic")))
    assert not [r for r in short if r.request_id in runs]
    assert [len(runs[r.request_id]) for r in normal] == [1] * 200
