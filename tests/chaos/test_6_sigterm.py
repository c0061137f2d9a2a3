"""Scenario 6: SIGTERM to a worker in the middle of a batch.

1. One worker whose forwards take 3 s. A first request keeps it busy while 10 more queue up;
   it then reads the 10 as one batch. When all their entries are pending for it, the test sends
   SIGTERM.

Result: the worker stops reading, finishes and publishes the batch, acks it, and exits 0 well
within shutdown_grace_s; nothing was left to reclaim; all 11 requests get 200 and the request
stream is empty.
"""

from __future__ import annotations

import asyncio
import signal
import time

from tests.chaos.load import Load, check_executions, count_logged
from tests.helpers import wait_until
from vramguard.shared.keys import GROUP, Keys

GRACE_S = 8


async def test_sigterm_mid_batch_drains_and_exits_0(chaos_stack, chaos_redis) -> None:
    chaos_stack.settings.update({"shutdown_grace_s": GRACE_S, "models__synthetic__max_batch_size": 10,
                                 "models__synthetic__params": '{"batch_ms": 3000}'})
    chaos_stack.start_gateway()
    worker = chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    stream = Keys(chaos_stack.settings["key_prefix"]).request_stream("synthetic")
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=10) as load:
        first = asyncio.ensure_future(load.request())

        def pending(n: int):  # noqa: ANN202
            async def check() -> bool:
                return (await chaos_redis.xpending(stream, GROUP))["pending"] == n

            return check

        await wait_until(pending(1), 10)
        requests = asyncio.gather(first, *(load.request() for _ in range(10)))

        queued = Keys(chaos_stack.settings["key_prefix"]).queued_requests("synthetic")

        async def all_queued() -> bool:
            return int(await chaos_redis.get(queued) or 0) == 11

        async def all_read() -> bool:  # the first answered, and every entry of the 10 delivered
            length = await chaos_redis.xlen(stream)
            return int(await chaos_redis.get(queued) or 0) == 10 and length > 0 and (
                await chaos_redis.xpending(stream, GROUP))["pending"] == length

        await wait_until(all_queued, 2.7)  # before the first forward ends, so one read takes all 10
        await wait_until(all_read, 10)  # the 10 are one batch, running
        worker.send_signal(signal.SIGTERM)
        term_s = time.monotonic()
        await requests
    exit_code = await asyncio.to_thread(worker.wait, GRACE_S + 5)
    exited_after_s = time.monotonic() - term_s
    tally = load.tally
    tally.report("6 SIGTERM mid-batch", time.monotonic() - started, exit_code=exit_code,
                 exited_after_s=round(exited_after_s, 1))
    tally.assert_each_answered_with_its_own()
    assert tally.ok == 11, tally.errors
    assert await check_executions(chaos_redis, chaos_stack.settings["key_prefix"], tally, set()) == 0
    assert count_logged(chaos_stack.log_dir, "entry reclaimed") == 0
    assert exit_code == 0 and exited_after_s < GRACE_S
    assert await chaos_redis.xlen(stream) == 0


async def test_gateway_sigterm_flips_readiness_drains_then_fails_the_rest(chaos_stack, chaos_redis) -> None:
    """Scenario 6b: SIGTERM to the gateway with two requests in flight.

    1. One worker with 1.5 s forwards; the gateway's shutdown_grace_s is 2 s. Request A is in a
       forward; request B is queued behind it (done at about 3 s). Then SIGTERM to the gateway.

    Result: /health/ready answers 503 at once and a new request gets 503 unavailable, while the
    port still answers; A (done within the grace period) gets 200; B gets 503 unavailable when
    the grace period ends; the gateway exits 0.
    """
    chaos_stack.settings.update({"shutdown_grace_s": 2, "models__synthetic__params": '{"batch_ms": 1500}'})
    chaos_stack.start_gateway()
    chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    stream = Keys(chaos_stack.settings["key_prefix"]).request_stream("synthetic")
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=4) as load:
        first = asyncio.ensure_future(load.request())

        async def depth(n: int, pending: int) -> bool:
            return (await chaos_redis.xlen(stream) == n
                    and (await chaos_redis.xpending(stream, GROUP))["pending"] == pending)

        await wait_until(lambda: depth(1, 1), 10)
        second = asyncio.ensure_future(load.request())
        await wait_until(lambda: depth(2, 1), 5)
        chaos_stack.gateway.send_signal(signal.SIGTERM)

        async def flipped() -> bool:  # uvicorn checks for the signal every 0.1 s
            return bool((await load._pools[0].get("/health/ready")).status_code == 503)

        await wait_until(flipped, 2, interval_s=0.05)
        ready = await load._pools[0].get("/health/ready")
        refused = await load.request()
        a, b = await first, await second
    exit_code = await asyncio.to_thread(chaos_stack.gateway.wait, 10)
    load.tally.report("6b gateway SIGTERM", time.monotonic() - started, exit_code=exit_code)
    load.tally.assert_each_answered_with_its_own()
    assert ready.status_code == 503 and "shutting down" in str(ready.json()["reasons"])
    assert (refused.status, refused.code) == (503, "unavailable")
    assert a.status == 200
    assert (b.status, b.code) == (503, "unavailable") and "shut down" in (b.message or "")
    assert exit_code == 0
