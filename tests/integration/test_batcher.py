"""The batch window on a real Redis stream: items (not entries) fill a batch, the window waits
only after a busy batch, and entries read past a full batch are carried over, not lost."""

from __future__ import annotations

import redis.asyncio as aioredis

from vramguard.shared.keys import GROUP
from vramguard.shared.protocol import ENTRY_FIELD, RequestId, RequestMessage
from vramguard.worker.batch.batcher import MIN_HELD_ENTRIES, Batcher


async def enqueue(redis: aioredis.Redis, stream: str, n_inputs: int, tag: str) -> None:
    msg = RequestMessage(RequestId(tag), "synthetic", list(range(n_inputs)), "rep", 10**13, 0)
    await redis.xadd(stream, {ENTRY_FIELD: msg.encode()})


async def make_batcher(redis: aioredis.Redis, stream: str, max_batch_size: int, max_wait_ms: float) -> Batcher:
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    return Batcher(redis, stream, "c1", max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, block_ms=50)


def tags(batch: list) -> list[str]:
    return [e.message.request_id for e in batch]


async def test_inputs_count_toward_max_batch_size_and_overflow_is_carried(redis_client) -> None:
    stream = "t:req:batcher1"
    batcher = await make_batcher(redis_client, stream, max_batch_size=4, max_wait_ms=0)
    for tag, n in [("a", 3), ("b", 2), ("c", 1)]:
        await enqueue(redis_client, stream, n, tag)
    first = await batcher.read_batch()
    assert tags(first) == ["a", "c"]  # a (3) + b (2) would be 5 > 4; c (1) still fits
    second = await batcher.read_batch()
    assert tags(second) == ["b"]  # b came from the carry-over, whole: it fits a batch
    assert await batcher.read_batch() == []


def ranges(batch: list) -> list[tuple[str, int, int]]:
    return [(s.message.request_id, s.start, s.stop) for s in batch]


async def test_an_entry_larger_than_the_cap_is_served_in_slices_after_small_ones(redis_client) -> None:
    stream = "t:req:batcher2"
    batcher = await make_batcher(redis_client, stream, max_batch_size=2, max_wait_ms=0)
    await enqueue(redis_client, stream, 5, "big")
    await enqueue(redis_client, stream, 1, "small")
    assert ranges(await batcher.read_batch()) == [("small", 0, 1), ("big", 0, 1)]
    assert ranges(await batcher.read_batch()) == [("big", 1, 3)]
    await enqueue(redis_client, stream, 1, "late")  # arrives while the big one is in progress
    assert ranges(await batcher.read_batch()) == [("late", 0, 1), ("big", 3, 4)]
    assert ranges(await batcher.read_batch()) == [("big", 4, 5)]
    assert await batcher.read_batch() == []


async def test_small_entries_leave_half_the_batch_to_a_large_one(redis_client) -> None:
    stream = "t:req:batcher7"
    batcher = await make_batcher(redis_client, stream, max_batch_size=4, max_wait_ms=0)
    await enqueue(redis_client, stream, 9, "big")
    for i in range(4):
        await enqueue(redis_client, stream, 1, f"s{i}")
    # The oldest small entry may take the whole room; later ones leave max_batch_size // 2.
    assert ranges(await batcher.read_batch()) == [("s0", 0, 1), ("s1", 0, 1), ("big", 0, 2)]
    assert ranges(await batcher.read_batch()) == [("s2", 0, 1), ("s3", 0, 1), ("big", 2, 4)]
    assert batcher.carried_ids and len(batcher.carried_ids) == 1  # the big one, still pending


async def test_a_worker_holds_a_bounded_number_of_entries(redis_client) -> None:
    stream = "t:req:batcher8"
    batcher = await make_batcher(redis_client, stream, max_batch_size=2, max_wait_ms=0)
    for i in range(3 * MIN_HELD_ENTRIES):
        await enqueue(redis_client, stream, 3, f"big{i}")
    held = []
    for _ in range(2 * MIN_HELD_ENTRIES):
        await batcher.read_batch()  # each read looks for newer (maybe small) entries
        held.append(len(batcher.carried_ids))
    assert max(held) == MIN_HELD_ENTRIES  # read ahead, up to the bound and no further
    delivered = (await redis_client.xpending(stream, GROUP))["pending"]  # nothing is acked here
    assert delivered < 3 * MIN_HELD_ENTRIES  # the rest stay in the stream for other workers


async def test_window_fills_the_batch_after_a_busy_batch(redis_client) -> None:
    stream = "t:req:batcher3"
    batcher = await make_batcher(redis_client, stream, max_batch_size=8, max_wait_ms=300)
    for i in range(2):
        await enqueue(redis_client, stream, 1, f"busy{i}")
    assert len(await batcher.read_batch()) == 2  # idle before: no window, takes what is there

    import asyncio

    async def trickle() -> None:
        for i in range(3):
            await asyncio.sleep(0.03)
            await enqueue(redis_client, stream, 1, f"late{i}")

    await enqueue(redis_client, stream, 1, "first")
    task = asyncio.create_task(trickle())
    batch = await batcher.read_batch()  # previous batch had 2 items: the window is open
    await task
    assert tags(batch) == ["first", "late0", "late1", "late2"]


async def test_a_window_nothing_more_arrives_in_ends_with_max_wait_ms_not_on_redis_timer(redis_client) -> None:
    """Ten windows of 10 ms, each after a busy batch, with one entry and nothing more arriving: they
    last about 10 ms each. A window read with XREADGROUP BLOCK lasted Redis's timer tick instead
    (100 ms at its default hz of 10): 1 s for the ten."""
    import time

    stream = "t:req:batcher9"
    batcher = await make_batcher(redis_client, stream, max_batch_size=8, max_wait_ms=10)
    spent_s = 0.0
    for i in range(10):
        for tag in ("a", "b"):
            await enqueue(redis_client, stream, 1, f"{tag}{i}")
        assert len(await batcher.read_batch()) == 2  # a busy batch: the next one gets a window
        await enqueue(redis_client, stream, 1, f"alone{i}")
        started = time.monotonic()
        assert tags(await batcher.read_batch()) == [f"alone{i}"]
        spent_s += time.monotonic() - started
    assert spent_s < 0.5, spent_s


async def test_no_window_when_idle(redis_client) -> None:
    stream = "t:req:batcher4"
    batcher = await make_batcher(redis_client, stream, max_batch_size=8, max_wait_ms=10_000)
    await enqueue(redis_client, stream, 1, "alone")
    import time

    started = time.monotonic()
    assert tags(await batcher.read_batch()) == ["alone"]
    assert time.monotonic() - started < 1.0  # did not sit out the 10 s window


async def test_undecodable_entry_is_returned_with_its_error(redis_client) -> None:
    stream = "t:req:batcher5"
    batcher = await make_batcher(redis_client, stream, max_batch_size=8, max_wait_ms=0)
    await redis_client.xadd(stream, {ENTRY_FIELD: b"\xc1garbage"})
    await redis_client.xadd(stream, {b"other": b"x"})
    batch = await batcher.read_batch()
    assert [e.message for e in batch] == [None, None]
    assert all(s.entry.decode_error for s in batch)


async def test_a_restarted_consumer_replays_its_own_pending_entries_first(redis_client) -> None:
    stream = "t:req:batcher6"
    first_life = await make_batcher(redis_client, stream, max_batch_size=2, max_wait_ms=0)
    for tag in ["a", "b", "c"]:
        await enqueue(redis_client, stream, 1, tag)
    assert tags(await first_life.read_batch()) == ["a", "b"]  # then the process dies without acking
    second_life = Batcher(redis_client, stream, "c1", max_batch_size=2, max_wait_ms=0, block_ms=50)
    assert tags(await second_life.read_batch()) == ["a", "b"]  # its own pending entries first
    assert tags(await second_life.read_batch()) == ["c"]
    assert await second_life.read_batch() == []
