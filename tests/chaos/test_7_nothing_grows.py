"""Scenario 7: nothing grows forever.

1. A gateway and two workers; 100 warm-up requests; then Redis' used_memory is recorded.
2. 50 clients send requests as fast as the stack answers them for LOAD_S seconds. The verdict
   is sized by time, not by the machine's speed: however many requests that is (about 600/s on
   a quiet 2-core machine, 150/s on a busy one), every one must be answered and everything they
   put in Redis must go away again. Throughput targets live in bench/, not here.

Result: every request gets 200 exactly once and ran exactly once; afterwards the request stream
holds no entry (each was acked and deleted together), no entry is pending, the reply stream holds
at most its init entry, the dead letter is empty, only the two workers' consumers exist, every admission record
expires within its TTL (bounded by rate x TTL), and, those removed, used_memory is back within
512 KiB of its value before (within MEMORY_SETTLE_S, as Redis shrinks its key tables in its cron).
"""

from __future__ import annotations

import time

import msgpack
import pytest
import redis.asyncio as aioredis

from tests.chaos.load import Load, check_executions
from tests.helpers import wait_until
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys

LOAD_S = 30
MIN_REQUESTS = 1000  # far below any machine that can run the suite; fewer means the stack stalled
SLACK_BYTES = 512 * 1024
MEMORY_SETTLE_S = 15


async def used_memory(redis: aioredis.Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


@pytest.mark.timeout(300)
async def test_streams_and_memory_return_to_baseline(chaos_stack, chaos_redis) -> None:
    chaos_stack.start_gateway()
    chaos_stack.start_worker()
    chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    keys = Keys(chaos_stack.settings["key_prefix"])
    stream = keys.request_stream("synthetic")
    async with Load(chaos_stack.url, clients=50) as load:
        await load.run_count(100)
        await chaos_redis.delete(keys.executions("synthetic"))  # the test-only log is not the system's memory
        await drop_admission_records(chaos_redis, keys)
        before_bytes = await used_memory(chaos_redis)
        started = time.monotonic()
        load.tally.results.clear()
        await load.run_for(LOAD_S)
        wall_s = time.monotonic() - started

    async def settled() -> bool:
        return await chaos_redis.xlen(stream) == 0 and (await chaos_redis.xpending(stream, GROUP))["pending"] == 0

    await wait_until(settled, 10)
    tally = load.tally
    ran_again = await check_executions(chaos_redis, keys.prefix, tally, set())
    await chaos_redis.delete(keys.executions("synthetic"))
    records = await drop_admission_records(chaos_redis, keys)
    (reply_stream,) = [k async for k in chaos_redis.scan_iter(match=keys.reply_stream("*"))]

    async def memory_back() -> bool:
        return await used_memory(chaos_redis) <= before_bytes + SLACK_BYTES

    # Tens of thousands of admission records grew Redis' key tables; its cron shrinks them again
    # (tryResizeHashTables) within moments of their deletion. Memory that stays is what this test catches.
    await wait_until(memory_back, MEMORY_SETTLE_S, interval_s=0.5)
    after_bytes = await used_memory(chaos_redis)
    tally.report(f"7 {LOAD_S} s of load, then memory", wall_s, requests_per_s=round(tally.sent / wall_s),
                 used_memory_before=before_bytes, used_memory_after=after_bytes,
                 reply_stream_len=await chaos_redis.xlen(reply_stream), admission_records=records)
    tally.assert_each_answered_with_its_own()
    assert ran_again == 0
    assert tally.ok == tally.sent >= MIN_REQUESTS, tally.errors
    assert await chaos_redis.xlen(reply_stream) <= 1  # the init entry
    assert await chaos_redis.xlen(keys.dead_letter_stream("synthetic")) == 0
    assert len(await chaos_redis.xinfo_consumers(stream, GROUP)) == 2
    assert after_bytes <= before_bytes + SLACK_BYTES  # also checked by the wait above, named here


async def drop_admission_records(redis: aioredis.Redis, keys: Keys) -> int:
    """Check that the admission records (kept for a re-sent XADD, fields of the model's records
    hash) are bounded: each expires ADMISSION_RECORD_TTL_MS after its call, and the expired ones are
    dropped by sampling, so they hold about rate x TTL and cannot grow forever; then delete them, so
    that used_memory compares what must not stay. Returns how many there were."""
    records = await redis.hgetall(keys.admissions("synthetic"))
    live = [call for call in records if call != b"_"]
    expired = [call for call in live if msgpack.unpackb(records[call])[0] <= now_ms()]
    assert len(expired) <= max(64, len(live) // 2), (len(expired), len(live))  # sampled away as they age
    await redis.delete(keys.admissions("synthetic"))
    return len(live)
