"""Packs (several requests in one stream entry, worker/batch/entries.py) served by an in-process worker on
a real Redis: each request answered on its own, the entry acked and the queued-requests counter
lowered with the last of them; a pack whose worker died split into entries of one request each,
served alone; a pack past max_deliveries dead-lettered with an error to every caller."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from tests.helpers import wait_until
from tests.integration.test_reclaim import RECLAIM, deliver_to, enqueue, replies, setup_stream
from tests.proxy import LossyProxy
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import (
    ENTRY_FIELD,
    PRIOR_DELIVERIES_FIELD,
    REQUESTS_FIELD,
    EntryId,
    ReplyMessage,
    RequestId,
    RequestMessage,
    pack_requests,
)
from vramguard.shared.redis_client import connect
from vramguard.worker.batch.batch_errors import answer_internal_error
from vramguard.worker.batch.batcher import Batcher
from vramguard.worker.batch.publish import ACK, Outgoing, publish_replies
from vramguard.worker.batch.reclaim import RUN_ALONE, Reclaimer


async def enqueue_pack(redis: aioredis.Redis, keys: Keys, reply_to: str, tags: list[str]) -> str:
    """XADD one pack of one-input requests and raise the queued-requests counter, as the gateway's admission
    script does for one call (gateway/admission/dispatch.py ADMISSION)."""
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


@pytest.mark.slow
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


def publish_args(keys: Keys) -> dict[str, object]:
    model = "synthetic"
    return {"request_stream": keys.request_stream(model), "dead_letter_stream": keys.dead_letter_stream(model),
            "queued_requests": keys.queued_requests(model), "reply_maxlen": 1000}


async def test_an_ack_re_sent_after_its_lost_reply_lowers_the_counter_once(
        redis_client, redis_server, key_prefix, settings_factory) -> None:  # type: ignore[no-untyped-def]
    """1. Two requests are queued and read; the counter says 2.
    2. The first is acked through a proxy that cuts the reply to the ack script: redis-py sends
       the call again, and Redis runs it twice.
    Result: one entry left, one request counted: the second run deleted nothing, so it lowered
    nothing (the counter is the one figure a second run could change)."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    first = await enqueue(redis_client, stream, reply_to, "a")
    await enqueue(redis_client, stream, reply_to, "b")
    await redis_client.set(keys.queued_requests("synthetic"), 2)
    await redis_client.xreadgroup(GROUP, "w", {stream: ">"}, count=10)
    await redis_client.script_load(ACK)  # so that the cut reply is the script's run, not NOSCRIPT
    async with LossyProxy(redis_server.port, every=1, max_lost=1) as proxy:
        client = connect(settings_factory(redis_url=proxy.url))
        try:
            await publish_replies(client, replies=[], entry_ids=[EntryId(first)], **publish_args(keys))
        finally:
            await client.aclose()
        assert proxy.lost == 1
    assert await queue_state(redis_client, keys) == (1, 1, 1)


async def test_a_pack_answered_after_another_worker_split_it_counts_nothing(
        redis_client, key_prefix, settings_factory) -> None:  # type: ignore[no-untyped-def]
    """1. Worker A reads a pack of three, then stalls past claim_idle_ms; another pack is queued.
    2. Worker B claims A's pack and splits it into three entries.
    3. A comes back and answers its three requests.
    Result: A's ack deletes nothing (the pack is gone), so the counter keeps all six requests
    still queued: the three split ones and the other pack's."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    await enqueue_pack(redis_client, keys, reply_to, ["a", "b", "c"])
    stalled = Batcher(redis_client, stream, "A", max_batch_size=3, max_wait_ms=0, block_ms=50, replay_history=False,
                      requests_per_entry=3)
    batch = await stalled.read_batch()
    await enqueue_pack(redis_client, keys, reply_to, ["d", "e", "f"])
    await asyncio.sleep(0.3)
    settings = settings_factory(model="synthetic", claim_idle_ms=200, reclaim_interval_ms=50, heartbeat_interval_ms=50)
    thief = Reclaimer(settings, redis_client, stream, keys.dead_letter_stream("synthetic"), "B", list)
    await thief.scan()
    assert await thief.claim_one() is None and thief.packs_split == 1
    await publish_replies(redis_client, replies=[], entry_ids=[s.entry_id for s in batch], ledger=stalled.ledger,
                          **publish_args(keys))
    assert await queue_state(redis_client, keys) == (4, 0, 6)


async def test_a_batch_task_failure_answers_only_the_pack_requests_not_yet_answered(
        redis_client, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. A pack of three is read; its first request is answered ok.
    2. The batch task fails (a worker bug) with all three in hand.
    Result: the other two get 500 internal; the first keeps its one ok reply, no second one."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    await enqueue_pack(redis_client, keys, reply_to, ["a", "b", "c"])
    batcher = Batcher(redis_client, stream, "W", max_batch_size=3, max_wait_ms=0, block_ms=50, replay_history=False)
    batch = await batcher.read_batch()
    first = batch[0].entry
    assert first.message is not None
    answered = Outgoing(reply_to, ReplyMessage(request_id=first.message.request_id, outputs=[1], worker_id="W"))
    await publish_replies(redis_client, replies=[answered], entry_ids=[first.entry_id], ledger=batcher.ledger,
                          **publish_args(keys))
    await answer_internal_error(redis_client, stream=stream, dead_letter_stream=keys.dead_letter_stream("synthetic"),
                                queued_requests=keys.queued_requests("synthetic"), worker_id="W",
                                entries=[s.entry for s in batch], exc=RuntimeError("bug"), reply_maxlen=1000,
                                ledger=batcher.ledger)
    got = sorted((r.request_id, r.error_code) for r in await replies(redis_client, reply_to))
    assert got == [("a", None), ("b", "internal"), ("c", "internal")]
    assert await queue_state(redis_client, keys) == (0, 0, 0)


async def test_a_restarted_consumer_replays_its_pending_pack_by_its_stream_id(
        redis_client, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. A consumer reads a pack of three and dies; its successor (same name) replays its own
    pending entries, two requests a batch. Result: both reads succeed (the history read goes on
    from the pack's stream id, not a request's), together the pack's three requests, once each."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    pack_id = await enqueue_pack(redis_client, keys, reply_to, ["a", "b", "c"])
    await redis_client.xreadgroup(GROUP, "c1", {stream: ">"}, count=10)
    successor = Batcher(redis_client, stream, "c1", max_batch_size=2, max_wait_ms=0, block_ms=50)
    ids = [s.entry_id for s in await successor.read_batch()] + [s.entry_id for s in await successor.read_batch()]
    assert ids == [f"{pack_id}#0", f"{pack_id}#1", f"{pack_id}#2"]


async def test_a_read_takes_at_most_two_batches_of_packed_requests(redis_client, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """Eight packs of eight wait; a worker with batches of eight reads. Result: it takes two packs
    (16 requests: its batch and the next), leaving six for other workers, not all 64."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    for pack in range(8):
        await enqueue_pack(redis_client, keys, reply_to, [f"r{pack}-{i}" for i in range(8)])
    batcher = Batcher(redis_client, stream, "W", max_batch_size=8, max_wait_ms=0, block_ms=50, replay_history=False,
                      requests_per_entry=8)
    assert len(await batcher.read_batch()) == 8
    assert (await redis_client.xpending(stream, GROUP))["pending"] == 2


@pytest.mark.slow
async def test_a_suspect_waiting_for_the_batch_in_flight_stays_its_workers(
        redis_client, start_worker, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """1. A worker runs two forwards at once, each 3 s; request x is in one.
    2. A request split from a dead worker's pack (a suspect) is read: it waits for x's forward,
       since a suspect runs with nothing else in flight, longer than claim_idle_ms.
    3. Another worker's reclaimer looks for stale entries meanwhile.
    Result: it finds none (the waiting suspect is kept fresh), and the suspect is answered once,
    by the worker that read it, after x."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    models = {"synthetic": {"max_inflight_batches": 2, "max_batch_size": 1, "max_wait_ms": 0,
                            "params": {"batch_ms": 3000, "item_ms": 0}}}
    slow = await start_worker(worker_name="slow", models=models, **RECLAIM)
    await enqueue(redis_client, stream, reply_to, "x")
    await wait_until(lambda: bool(slow.worker._inflight), 5)
    suspect = RequestMessage(RequestId("s"), "synthetic", [5], reply_to, now_ms() + 60_000, now_ms())
    await redis_client.xadd(stream, {ENTRY_FIELD: suspect.encode(), PRIOR_DELIVERIES_FIELD: b"1"})
    await asyncio.sleep(1.2)  # past claim_idle_ms (0.7 s), x's forward still running
    thief = Reclaimer(slow.worker.settings, redis_client, stream, keys.dead_letter_stream("synthetic"), "thief", list)
    await thief.scan()
    assert await thief.claim_one() is None

    async def both_answered() -> bool:
        return len(await replies(redis_client, reply_to)) >= 2

    await wait_until(both_answered, 15)
    got = [(r.request_id, r.worker_id) for r in await replies(redis_client, reply_to)]
    assert got == [("x", "slow"), ("s", "slow")]


async def test_a_split_request_counts_its_runs_alone_not_the_deaths_of_its_holders(
        redis_client, key_prefix, settings_factory) -> None:  # type: ignore[no-untyped-def]
    """max_deliveries is 2. A request split from a pack that killed one worker (prior 1) was read
    ahead by a worker that died running a sibling, and is claimed: its entry's delivery count is
    now 2, plus 1 prior.
    Result: it may run (1 prior + this run = 2), and that run is recorded; one more may not (3); a
    re-sent call (its reply lost) answers the run it recorded, counting nothing twice."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    message = RequestMessage(RequestId("a"), "synthetic", [1], reply_to, now_ms() + 60_000, now_ms())
    await redis_client.xadd(stream, {ENTRY_FIELD: message.encode(), PRIOR_DELIVERIES_FIELD: b"1"})
    await deliver_to(redis_client, stream, "died-holding-it")
    settings = settings_factory(model="synthetic", max_deliveries=2, claim_idle_ms=200, reclaim_interval_ms=50,
                                heartbeat_interval_ms=50)
    reclaimer = Reclaimer(settings, redis_client, stream, keys.dead_letter_stream("synthetic"), "w", list)
    await asyncio.sleep(0.3)
    await reclaimer.scan()
    suspect = await reclaimer.claim_one()
    assert suspect is not None and suspect.delivery_count == 3
    assert await reclaimer.may_run(suspect.entry)
    assert not await reclaimer.may_run(suspect.entry)
    runs = keys.suspect_runs("synthetic", suspect.entry.entry_id)
    script = redis_client.register_script(RUN_ALONE)
    await redis_client.hset(runs, "token", "t1")  # the recorded run's token, as a re-sent call brings it
    assert await script(keys=[runs], args=["t1", 1, 2, 60_000]) == 1
    assert await redis_client.hget(runs, "n") == b"1"


async def test_a_backlog_of_small_packs_fills_one_batch(redis_client, key_prefix) -> None:  # type: ignore[no-untyped-def]
    """Ten requests wait in packs of 3, 3, 2, 1 and 1 (as calls of a busy gateway admit them); a
    worker with batches of ten, whose last read was a single request, reads. Result: one batch of
    all ten: a read that comes back full is followed at once by one sized by what it carried."""
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    await enqueue(redis_client, stream, reply_to, "first")
    batcher = Batcher(redis_client, stream, "W", max_batch_size=10, max_wait_ms=0, block_ms=50, replay_history=False,
                      requests_per_entry=10)
    assert len(await batcher.read_batch()) == 1
    for n, size in enumerate([3, 3, 2]):
        await enqueue_pack(redis_client, keys, reply_to, [f"p{n}-{i}" for i in range(size)])
    for tag in ("s0", "s1"):
        await enqueue(redis_client, stream, reply_to, tag)
    batch = await batcher.read_batch()
    assert len(batch) == 10 and (await redis_client.xpending(stream, GROUP))["pending"] == 6
