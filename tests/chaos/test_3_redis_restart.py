"""Scenario 3: Redis killed and restarted, empty, under load.

1. A gateway and two workers on a Redis of their own; 20 clients send requests with
   timeout_ms=2000 for 16 s (pausing 50 ms after an error).
2. At 4 s the test SIGKILLs Redis; at 8 s it starts a fresh, empty Redis on the same port.

Result: every request gets exactly one answer; during the outage the gateway answers 503
unavailable fast (requests caught in flight get 503 or 504 by their deadline), none later than
its deadline plus a slack of three times the slowest of 20 concurrent immediate answers measured
before the load (at least 1 s); the workers back off and stay up (no exit); the consumer group, the
request stream and the reply stream are recreated by themselves, and every request sent from
5 s after Redis is back gets 200. Every request answered 200 after the restart ran exactly once
(the execution log of the runs before it died with the old Redis).
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.chaos.conftest import CHAOS_SETTINGS
from tests.chaos.load import Load, Tally, check_executions, slowest_immediate_answer_s
from tests.helpers import RedisServer, Stack

TIMEOUT_MS = 2000
KILL_AT_S, RESTART_AT_S, LOAD_S = 4.0, 8.0, 16.0
RECOVERY_S = 5.0


@pytest.fixture
def own_stack(fast_settings: dict[str, object], tmp_path: Path) -> Iterator[tuple[Stack, RedisServer]]:
    server = RedisServer()
    server.start()
    values = {k: v for k, v in fast_settings.items() if k != "redis_url"}
    stack = Stack(server.url, tmp_path, **{**values, **CHAOS_SETTINGS})
    yield stack, server
    stack.stop()
    server.stop()


async def test_redis_restart_empty_under_load(own_stack: tuple[Stack, RedisServer]) -> None:
    stack, server = own_stack
    stack.start_gateway()
    workers = [stack.start_worker(), stack.start_worker()]
    await stack.wait_ready()
    started = time.monotonic()
    restarted_s = 0.0
    async with Load(stack.url, clients=20, timeout_ms=TIMEOUT_MS) as load:
        slack_s = max(1.0, 3 * await slowest_immediate_answer_s(load, 20))

        async def outage() -> None:
            nonlocal restarted_s
            await asyncio.sleep(KILL_AT_S)
            server.stop(signal.SIGKILL)
            await asyncio.sleep(RESTART_AT_S - KILL_AT_S)
            await asyncio.to_thread(server.start)
            restarted_s = time.monotonic()

        await asyncio.gather(load.run_for(LOAD_S, pause_s=lambda r: 0.0 if r.status == 200 else 0.05), outage())
    tally = load.tally
    unavailable = [r for r in tally.results if r.status == 503]
    first_ok_after = min(r.answered_s for r in tally.results if r.status == 200 and r.sent_s >= restarted_s)
    tally.report("3 Redis killed and restarted empty", time.monotonic() - started,
                 service_back_after_s=round(first_ok_after - restarted_s, 1),
                 median_503_ms=round(statistics.median(r.latency_s for r in unavailable) * 1000),
                 slowest_ms=round(max(r.latency_s for r in tally.results) * 1000))
    tally.assert_each_answered_with_its_own()
    assert unavailable and set(tally.errors) <= {"503 unavailable", "504 deadline_exceeded"}, tally.errors
    assert max(r.latency_s for r in tally.results) < TIMEOUT_MS / 1000 + slack_s
    assert statistics.median(r.latency_s for r in unavailable) < 0.5
    late = [r for r in tally.results if r.sent_s >= restarted_s + RECOVERY_S]
    assert late and all(r.status == 200 for r in late), [(r.status, r.message) for r in late if r.status != 200][:5]
    assert all(proc.poll() is None for proc in workers)  # backed off, never exited
    after = Tally([r for r in tally.results if r.sent_s >= restarted_s])
    client = aioredis.Redis.from_url(server.url)
    try:
        assert await check_executions(client, str(stack.settings["key_prefix"]), after, set()) == 0
    finally:
        await client.aclose()
