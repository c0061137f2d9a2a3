"""Packs (several requests in one stream entry, worker/entries.py) served by an in-process worker on
a real Redis: each request answered on its own, the entry acked and the queued-requests counter
lowered with the last of them; a pack whose worker died split into entries of one request each,
served alone; a pack past max_deliveries dead-lettered with an error to every caller."""

from __future__ import annotations

import redis.asyncio as aioredis

from tests.helpers import wait_until
from tests.integration.test_reclaim import RECLAIM, deliver_to, replies, setup_stream
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import ENTRY_FIELD, REQUESTS_FIELD, RequestId, RequestMessage, pack_requests


async def enqueue_pack(redis: aioredis.Redis, keys: Keys, reply_to: str, tags: list[str]) -> str:
    """XADD one pack of one-input requests and raise the queued-requests counter, as the gateway's admission
    script does for one call (gateway/dispatch.py ADMISSION)."""
    packed = [RequestMessage(RequestId(tag), "synthetic", [i], reply_to, now_ms() + 60_000, now_ms()).encode()
              for i, tag in enumerate(tags)]
    entry_id = await redis.xadd(keys.request_stream("synthetic"), {REQUESTS_FIELD: pack_requests(packed)})
    await redis.incrby(keys.queued_requests("synthetic"), len(tags))
    return entry_id.decode()


async def queue_state(redis: aioredis.Redis, keys: Keys) -> tuple[int, int, int]:
    """(XLEN, pending entries, the queued-requests counter) of synthetic's queue."""
    stream = keys.request_stream("synthetic")
    pending = (await redis.xpending(stream, GROUP))["pending"]
    return await redis.xlen(stream), pending, int(await redis.get(keys.queued_requests("synthetic")) or 0)


async def drained(redis: aioredis.Redis, keys: Keys) -> bool:
    """Nothing queued, nothing pending, and the counter at 0."""
    return await queue_state(redis, keys) == (0, 0, 0)


async def test_a_pack_is_answered_request_by_request_and_acked_with_its_last(
        redis_client, start_worker, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. A worker takes batches of 2 and spends 1 s per forward.
    2. One pack of three requests is queued.
    Result: the first forward answers two of them while the entry stays queued and pending, and the
    counter still says 3; the second answers the third, and only then is the entry acked and
    deleted and the counter back at 0. Each request gets its own input back."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    await start_worker(models={"synthetic": {"max_batch_size": 2, "max_wait_ms": 0,
                                             "params": {"batch_ms": 1000, "item_ms": 0}}})
    await enqueue_pack(redis_client, keys, reply_to, ["a", "b", "c"])

    async def answered(n: int) -> bool:
        return len(await replies(redis_client, reply_to)) >= n

    await wait_until(lambda: answered(2), 20)
    assert await queue_state(redis_client, keys) == (1, 1, 3)
    await wait_until(lambda: answered(3), 20)
    got = await replies(redis_client, reply_to)
    assert sorted(r.request_id for r in got) == ["a", "b", "c"] and all(r.ok for r in got)
    assert [r.batch_size for r in got] == [2, 2, 1]
    await wait_until(lambda: drained(redis_client, keys), 5)  # the ack follows the replies


async def test_a_pack_whose_worker_died_is_split_and_each_request_served_alone(
        redis_client, start_worker, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. A pack of three is read by a consumer that never acks it (its worker died).
    2. A worker starts; the pack idles past claim_idle_ms.
    Result: the worker splits it into three entries of one request (each carrying the pack's one
    delivery), then serves each alone (batch size 1) as the suspect it is; every request is
    answered once and ok, nothing is dead-lettered, the queue is empty and the counter 0."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    await enqueue_pack(redis_client, keys, reply_to, ["a", "b", "c"])
    await deliver_to(redis_client, stream, "killed-worker")
    handle = await start_worker(**RECLAIM)

    async def all_answered() -> bool:
        return len(await replies(redis_client, reply_to)) == 3

    await wait_until(all_answered, 15)
    got = await replies(redis_client, reply_to)
    assert sorted(r.request_id for r in got) == ["a", "b", "c"] and all(r.ok for r in got)
    assert [r.batch_size for r in got] == [1, 1, 1]
    assert handle.worker.reclaimer.packs_split == 1 and handle.worker.reclaimer.dead_lettered == 0
    await wait_until(lambda: drained(redis_client, keys), 5)
    assert await redis_client.xlen(keys.dead_letter_stream("synthetic")) == 0


async def test_a_pack_past_max_deliveries_is_dead_lettered_with_an_error_to_every_caller(
        redis_client, start_worker, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. max_deliveries is 1. A pack of two is read by a consumer that died.
    2. A worker claims it: its second delivery.
    Result: the pack is not split but dead-lettered whole (its fields kept, with the reason), both
    callers get 500 model_error naming max_deliveries, the queue is empty and the counter 0."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    pack_id = await enqueue_pack(redis_client, keys, reply_to, ["a", "b"])
    await deliver_to(redis_client, stream, "killed-worker")
    handle = await start_worker(max_deliveries=1, **RECLAIM)

    async def both_answered() -> bool:
        return len(await replies(redis_client, reply_to)) == 2

    await wait_until(both_answered, 15)
    got = await replies(redis_client, reply_to)
    assert sorted(r.request_id for r in got) == ["a", "b"]
    assert all(r.error_code == "model_error" and "max_deliveries=1" in (r.error_message or "") for r in got)
    (dead,) = await redis_client.xrange(keys.dead_letter_stream("synthetic"))
    assert REQUESTS_FIELD in dead[1] and ENTRY_FIELD not in dead[1] and dead[1][b"entry_id"] == pack_id.encode()
    assert handle.worker.reclaimer.packs_split == 0 and handle.worker.reclaimer.dead_lettered == 1
    await wait_until(lambda: drained(redis_client, keys), 5)


async def test_a_slow_live_worker_keeps_its_pack(redis_client, start_worker, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. A worker whose forward takes 2.5 s reads a pack of two (one batch), and a second worker
       starts: the pack's forward outlasts claim_idle_ms three times over.
    Result: the first worker keeps the pack's idle time fresh through its stream id, so nobody
    claims or splits it: both requests are answered once, by it."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    slow = await start_worker(worker_name="slow", models={"synthetic": {"params": {"batch_ms": 2500}}}, **RECLAIM)
    pack_id = await enqueue_pack(redis_client, keys, reply_to, ["a", "b"])

    async def read_by_slow() -> bool:
        held = await redis_client.xpending_range(stream, GROUP, "-", "+", 10, consumername="slow")
        return [p["message_id"].decode() for p in held] == [pack_id]

    await wait_until(read_by_slow, 5)
    thief = await start_worker(worker_name="thief", **RECLAIM)

    async def both_answered() -> bool:
        return len(await replies(redis_client, reply_to)) >= 2

    await wait_until(both_answered, 15)
    await wait_until(lambda: drained(redis_client, keys), 5)
    got = await replies(redis_client, reply_to)
    assert sorted(r.request_id for r in got) == ["a", "b"] and {r.worker_id for r in got} == {"slow"}
    assert thief.worker.reclaimer.claimed == 0 and slow.worker.reclaimer.claimed == 0
