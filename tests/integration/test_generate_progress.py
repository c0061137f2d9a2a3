"""worker/generate/progress.py on a real Redis: the progress write is fenced on the entry's owner
in the consumer group, so a worker that lost its entry to a reclaim (or whose entry was acked)
writes nothing and learns it must stop."""

from __future__ import annotations

import redis.asyncio as aioredis

from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import EntryId, RequestId
from vramguard.worker.generate.progress import read_progress, write_progress
from vramguard.worker.generate.sampling import SamplingParams
from vramguard.worker.generate.sequence import Sequence

MODEL = "simlm"


async def _entry(redis: aioredis.Redis, keys: Keys, consumer: str) -> EntryId:
    stream = keys.request_stream(MODEL)
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    await redis.xadd(stream, {b"e": b"x"})
    [[_s, [(entry_id, _f)]]] = await redis.xreadgroup(GROUP, consumer, {stream: b">"}, count=1)
    return EntryId(entry_id.decode())


def _sequence(entry_id: EntryId, tokens: list[int]) -> Sequence:
    return Sequence(request_id=RequestId("r1"), entry_id=entry_id, reply_to="rep", deadline_ms=now_ms() + 60_000,
                    prompt_ids=[1, 2], max_tokens=16, sampling=SamplingParams(0.0, 1.0, 7), generated=tokens,
                    chunk=len(tokens), text_sent=3 * len(tokens))


async def test_progress_is_written_only_while_the_worker_owns_the_entry(redis_client: aioredis.Redis,
                                                                         key_prefix: str) -> None:
    keys = Keys(key_prefix)
    entry_id = await _entry(redis_client, keys, "a")
    assert await write_progress(redis_client, keys, MODEL, [_sequence(entry_id, [5, 6])], now_ms(), "a") == []
    # Worker "a" stalls past claim_idle_ms; "b" claims the entry (XAUTOCLAIM/XCLAIM) and resumes it.
    await redis_client.xclaim(keys.request_stream(MODEL), GROUP, "b", 0, [entry_id])
    stale = _sequence(entry_id, [5, 6, 7, 8])
    assert await write_progress(redis_client, keys, MODEL, [stale], now_ms(), "a") == [stale]
    progress = await read_progress(redis_client, keys, MODEL, "r1")
    assert progress is not None and progress.tokens == [5, 6]  # "a"'s late write did not land
    resumed = _sequence(entry_id, [5, 6, 9])
    assert await write_progress(redis_client, keys, MODEL, [resumed], now_ms(), "b") == []
    # Acked (finished by whoever held it): nobody owns it any more.
    await redis_client.xack(keys.request_stream(MODEL), GROUP, entry_id)
    assert await write_progress(redis_client, keys, MODEL, [resumed], now_ms(), "b") == [resumed]
