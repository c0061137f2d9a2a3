"""worker/generate/intake.py on a real Redis: the admission window of an idle worker ends as soon as
it has read the room the pool has, not when the window closes."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from vramguard.shared.keys import GROUP, Keys
from vramguard.worker.generate.intake import Intake


async def test_the_admission_window_ends_once_the_room_is_read(redis_client: aioredis.Redis, key_prefix: str) -> None:
    """1. An idle worker that ran two sequences at once before (the window opens), a 30 s window.
    2. One entry in the stream; a read for a room of 3 blocks; two more entries 200 ms later.
    Result: the read returns the three entries within 10 s, not after the window's 30 s."""
    stream = Keys(key_prefix).request_stream("simlm")
    await redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    intake = Intake(stream, "w1", window_ms=30_000)
    intake.note_running(2)
    first = await redis_client.xadd(stream, {b"e": b"1"})
    reading = asyncio.ensure_future(intake.read(redis_client, 3, block_ms=1000))
    await asyncio.sleep(0.2)
    later = [await redis_client.xadd(stream, {b"e": str(i).encode()}) for i in (2, 3)]
    entries = await asyncio.wait_for(reading, 10)
    assert [e.entry_id for e in entries] == [i.decode() for i in (first, *later)]
    assert intake.peak_running == 0  # a busy period begins with this intake
