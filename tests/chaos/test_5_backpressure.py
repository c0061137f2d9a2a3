"""Scenario 5: a queue bound of 100 under 500 concurrent clients.

1. One worker serves batches of up to 20 items in 100 ms (about 200 items/s); the model's
   queue_bound is 100.
2. 500 clients send one request each, all at once; a client refused with 429 waits Retry-After
   seconds and tries again.
3. Meanwhile the test samples XLEN (queued + in flight) every 20 ms.

Result: requests past the bound get 429 queue_full with a Retry-After in [1, 60] s, without
being enqueued (XLEN never exceeds 100); every accepted request gets 200; every client is
served in the end.
"""

from __future__ import annotations

import asyncio
import signal
import time

from tests.chaos.load import Load, Result, check_executions
from vramguard.shared.keys import Keys

BOUND = 100
CLIENTS = 500


async def test_queue_bound_answers_429_with_retry_after(chaos_stack, chaos_redis) -> None:
    chaos_stack.settings.update({"models__synthetic__queue_bound": BOUND, "models__synthetic__max_batch_size": 20,
                                 "models__synthetic__params": '{"batch_ms": 100}'})
    chaos_stack.start_gateway()
    chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    queued = Keys(chaos_stack.settings["key_prefix"]).queued_requests("synthetic")
    depths: list[int] = []
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=CLIENTS) as load:

        async def client() -> list[Result]:
            attempts = [await load.request()]
            while attempts[-1].status == 429 and len(attempts) < 20:
                await asyncio.sleep(int(attempts[-1].retry_after or "1"))
                attempts.append(await load.request())
            return attempts

        async def sample() -> None:
            while not clients.done():
                depths.append(int(await chaos_redis.get(queued) or 0))
                await asyncio.sleep(0.02)

        clients = asyncio.gather(*(client() for _ in range(CLIENTS)))
        _, per_client = await asyncio.gather(sample(), clients)
    tally = load.tally
    refused = [r for r in tally.results if r.status == 429]
    tally.report("5 queue bound 100, 500 clients", time.monotonic() - started, peak_queued=max(depths),
                 retry_after_s=sorted({r.retry_after for r in refused}))
    tally.assert_each_answered_with_its_own()
    assert await check_executions(chaos_redis, chaos_stack.settings["key_prefix"], tally, set()) == 0
    assert refused and all(r.code == "queue_full" for r in refused)
    assert all(r.retry_after is not None and 1 <= int(r.retry_after) <= 60 for r in refused)
    assert set(tally.errors) == {"429 queue_full"}  # every accepted request succeeded
    assert all(attempts[-1].status == 200 for attempts in per_client)  # each client served in the end
    assert max(depths) <= BOUND


async def test_retry_after_grows_while_the_worker_is_stalled(chaos_stack) -> None:
    """1. One worker serves one request at a time in 50 ms (about 20 a second); queue_bound 20.
    2. 30 clients keep sending for 3 s: the queue sits at its bound.
    3. At 2.5 s the worker is stopped (SIGSTOP) for 16 s: a request every second for 5 s, then
       none for 11 s (past the rate's 10 s window: no demand and no reply, the 30 clients'
       requests still waiting), then one more.
    Result: while the worker drains, a refusal's Retry-After is what the backlog takes at its rate
    (a second or two); once it stalls, Retry-After grows with the stall, past the draining one,
    and after the silent window it is at least 10 s (a gateway that took the silence for idleness
    answered 1 s: no rate known)."""
    chaos_stack.settings.update({"models__synthetic__queue_bound": 20, "models__synthetic__max_batch_size": 1,
                                 "models__synthetic__params": '{"batch_ms": 50}'})
    chaos_stack.start_gateway()
    worker = chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    # The probes of the stall have a connection of their own: the 30 clients' requests queued
    # before the stop hold theirs until their deadline, and a probe waiting for one of those would
    # reach the gateway only then (after 10 s without demand or reply: an idle gateway's answer).
    async with Load(chaos_stack.url, clients=30, timeout_ms=20_000) as load, \
            Load(chaos_stack.url, clients=1, timeout_ms=20_000) as probe:
        clients = asyncio.ensure_future(load.run_for(3))
        await asyncio.sleep(2.5)
        worker.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        serving = [int(r.retry_after) for r in load.tally.results if r.status == 429 and r.retry_after]
        stalled: list[int] = []
        try:
            while time.monotonic() - stopped < 5:
                result = await probe.request()
                if result.status == 429 and result.retry_after:
                    stalled.append(int(result.retry_after))
                await asyncio.sleep(1)
            await asyncio.sleep(11)
            after_silence = await probe.request()
        finally:
            worker.send_signal(signal.SIGCONT)
        await clients
    print(f"Retry-After while draining {sorted(set(serving))}, then stalled {stalled}, "
          f"after 11 s of silence {after_silence.status} {after_silence.retry_after}")
    assert serving and stalled, (serving, stalled)
    assert stalled == sorted(stalled) and stalled[-1] > max(serving), (serving, stalled)
    assert after_silence.status == 429 and int(after_silence.retry_after or 0) >= max(10, stalled[-1]), after_silence
