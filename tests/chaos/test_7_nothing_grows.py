"""Scenario 7: nothing grows forever.

1. A gateway and two workers; 100 warm-up requests; then Redis' used_memory is recorded.
2. 50 clients send the issue's 20,000 requests as fast as the stack answers them (about 600/s
   on a quiet 2-core machine, so about 35 s rather than the issue's 60 s: the count is what
   fills the streams, the pace only changes how long it takes).

Result: all 20,000 get 200 exactly once; afterwards the request stream holds no entry (each was
acked and deleted together), no entry is pending, the reply stream holds at most its init entry,
the dead letter is empty, only the two workers' consumers exist, and used_memory is back within
512 KiB of its value before the load.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from shared.keys import GROUP, Keys
from tests.chaos.load import Load
from tests.helpers import wait_until

REQUESTS = 20_000
SLACK_BYTES = 512 * 1024


async def used_memory(redis: aioredis.Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def test_streams_and_memory_return_to_baseline(chaos_stack, chaos_redis) -> None:
    chaos_stack.start_gateway()
    chaos_stack.start_worker()
    chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    keys = Keys(chaos_stack.settings["key_prefix"])
    stream = keys.request_stream("synthetic")
    async with Load(chaos_stack.url, clients=50) as load:
        await load.run_count(100)
        before_bytes = await used_memory(chaos_redis)
        started = time.monotonic()
        load.tally.results.clear()
        await load.run_count(REQUESTS)
        wall_s = time.monotonic() - started

    async def settled() -> bool:
        return await chaos_redis.xlen(stream) == 0 and (await chaos_redis.xpending(stream, GROUP))["pending"] == 0

    await wait_until(settled, 10)
    (reply_stream,) = [k async for k in chaos_redis.scan_iter(match=keys.reply_stream("*"))]
    after_bytes = await used_memory(chaos_redis)
    tally = load.tally
    tally.report(f"7 {REQUESTS} requests, then memory", wall_s, used_memory_before=before_bytes,
                 used_memory_after=after_bytes, reply_stream_len=await chaos_redis.xlen(reply_stream))
    tally.assert_exactly_once()
    assert tally.ok == REQUESTS, tally.errors
    assert await chaos_redis.xlen(reply_stream) <= 1  # the init entry
    assert await chaos_redis.xlen(keys.dead_letter_stream("synthetic")) == 0
    assert len(await chaos_redis.xinfo_consumers(stream, GROUP)) == 2
    assert after_bytes <= before_bytes + SLACK_BYTES
