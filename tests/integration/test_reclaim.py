"""worker/batch/reclaim.py on a real Redis: stale entries of a dead consumer are claimed and answered,
a slow live worker keeps its batch, suspects run alone, an entry past max_deliveries goes to the
dead letter with an error reply, and consumers of dead workers are removed."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from tests.helpers import wait_until
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import ENTRY_FIELD, ReplyMessage, RequestId, RequestMessage
from vramguard.worker.batch.reclaim import Reclaimer

RECLAIM = {"claim_idle_ms": 700, "reclaim_interval_ms": 100, "heartbeat_interval_ms": 200}


async def setup_stream(redis: aioredis.Redis, keys: Keys) -> tuple[str, str]:
    stream, reply_to = keys.request_stream("synthetic"), keys.reply_stream("test")
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    await redis.xadd(reply_to, {b"init": b"1"})
    return stream, reply_to


async def enqueue(redis: aioredis.Redis, stream: str, reply_to: str, tag: str, value: object = 0) -> str:
    msg = RequestMessage(RequestId(tag), "synthetic", [value], reply_to, now_ms() + 30_000, now_ms())
    return (await redis.xadd(stream, {ENTRY_FIELD: msg.encode()})).decode()


async def replies(redis: aioredis.Redis, reply_to: str) -> list[ReplyMessage]:
    return [r for _id, f in await redis.xrange(reply_to) for r in ReplyMessage.from_entry(f)]


async def deliver_to(redis: aioredis.Redis, stream: str, consumer: str, times: int = 1) -> None:
    """Deliver every entry to `consumer` `times` times, as workers that died running it would."""
    await redis.xreadgroup(GROUP, consumer, {stream: ">"}, count=100)
    for _ in range(times - 1):
        await redis.xreadgroup(GROUP, consumer, {stream: "0"}, count=100)  # history reads count too


async def test_entries_of_a_dead_consumer_are_reclaimed_and_answered_alone(
    redis_client, start_worker, key_prefix
) -> None:
    stream, reply_to = await setup_stream(redis_client, Keys(key_prefix))
    tags = [f"r{i}" for i in range(4)]
    for tag in tags:
        await enqueue(redis_client, stream, reply_to, tag)
    await deliver_to(redis_client, stream, "killed-worker")  # read, never acked: it "died"
    handle = await start_worker(**RECLAIM)

    async def all_answered() -> bool:
        return len(await replies(redis_client, reply_to)) == 4

    await wait_until(all_answered, 10)
    got = await replies(redis_client, reply_to)
    assert sorted(r.request_id for r in got) == tags and all(r.ok for r in got)
    assert all(r.batch_size == 1 for r in got)  # suspects run alone
    assert handle.worker.reclaimer.claimed == 4
    assert await redis_client.xlen(stream) == 0  # acked and deleted
    assert (await redis_client.xpending(stream, GROUP))["pending"] == 0


@pytest.mark.slow
async def test_a_slow_live_worker_keeps_its_batch(redis_client, gateway, start_worker) -> None:
    slow = await start_worker(worker_name="slow", models={"synthetic": {"params": {"batch_ms": 2500}}}, **RECLAIM)

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    pending = asyncio.create_task(gateway.post("/v1/models/synthetic/infer", json={"inputs": [7]}))
    await wait_until(lambda: slow.worker.stats.batches == 0 and bool(slow.worker.held_entries()), 5)
    thief = await start_worker(worker_name="thief", **RECLAIM)
    response = await pending  # 2.5 s: more than three times claim_idle_ms
    assert response.status_code == 200 and response.json()["outputs"] == [7]
    assert thief.worker.reclaimer.claimed == 0
    assert gateway.app.state.dispatcher._listener.replies_dropped == 0  # answered once


async def test_an_entry_past_max_deliveries_goes_to_the_dead_letter(redis_client, start_worker, key_prefix) -> None:
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    await enqueue(redis_client, stream, reply_to, "poison", {"fault": "exit"})
    await deliver_to(redis_client, stream, "killed-worker", times=3)  # killed three workers already
    handle = await start_worker(max_deliveries=3, fault_injection=True, **RECLAIM)

    async def answered() -> bool:
        return len(await replies(redis_client, reply_to)) == 1

    await wait_until(answered, 10)
    (reply,) = await replies(redis_client, reply_to)
    assert reply.request_id == "poison" and reply.error_code == "model_error"
    assert "dead-letter" in (reply.error_message or "") and "3 times" in (reply.error_message or "")
    (dead,) = await redis_client.xrange(keys.dead_letter_stream("synthetic"))
    assert RequestMessage.decode(dead[1][ENTRY_FIELD]).request_id == "poison"
    assert await redis_client.xlen(stream) == 0
    assert handle.worker.reclaimer.dead_lettered == 1 and handle.worker.stats.forwards == 0  # it never ran again


async def test_a_restarted_worker_redelivers_its_own_entries_first_one_at_a_time(
    redis_client, start_worker, key_prefix
) -> None:
    stream, reply_to = await setup_stream(redis_client, Keys(key_prefix))
    for tag in ["a", "b", "c"]:
        await enqueue(redis_client, stream, reply_to, tag)
    await deliver_to(redis_client, stream, "stable-name")  # its previous life
    handle = await start_worker(worker_name="stable-name", **{**RECLAIM, "claim_idle_ms": 60_000})

    async def answered() -> bool:
        return len(await replies(redis_client, reply_to)) == 3

    await wait_until(answered, 10)  # far sooner than claim_idle_ms: its own, not reclaimed as stale
    got = await replies(redis_client, reply_to)
    assert [r.request_id for r in got] == ["a", "b", "c"] and all(r.batch_size == 1 for r in got)
    assert handle.worker.reclaimer.claimed == 3


async def test_consumers_of_dead_workers_are_removed(redis_client, settings_factory, key_prefix) -> None:
    keys = Keys(key_prefix)
    stream, reply_to = await setup_stream(redis_client, keys)
    for tag in ["done", "held", "mine"]:
        await enqueue(redis_client, stream, reply_to, tag)
    [[_s, [(done_id, _f)]]] = await redis_client.xreadgroup(GROUP, "ghost-idle", {stream: ">"}, count=1)
    await redis_client.xack(stream, GROUP, done_id)  # nothing pending any more
    await redis_client.xreadgroup(GROUP, "ghost-holding", {stream: ">"}, count=1)  # one pending
    await redis_client.xreadgroup(GROUP, "me", {stream: ">"}, count=1)
    settings = settings_factory(model="synthetic", consumer_idle_ms=1500, block_ms=100, **RECLAIM)
    reclaimer = Reclaimer(settings, redis_client, stream, keys.dead_letter_stream("synthetic"), "me", list)
    assert await reclaimer.remove_dead_consumers() == []  # nobody idle long enough yet
    await asyncio.sleep(1.6)
    assert await reclaimer.remove_dead_consumers() == ["ghost-idle"]
    # never one with pending entries (deleting it would drop them from the PEL), never itself
    names = {c["name"].decode() for c in await redis_client.xinfo_consumers(stream, GROUP)}
    assert names == {"ghost-holding", "me"}
    assert (await redis_client.xpending(stream, GROUP))["pending"] == 2


async def test_the_reclaim_scan_removes_dead_consumers_by_itself(redis_client, start_worker, key_prefix) -> None:
    stream, reply_to = await setup_stream(redis_client, Keys(key_prefix))
    await enqueue(redis_client, stream, reply_to, "done")
    [[_s, [(done_id, _f)]]] = await redis_client.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)
    await redis_client.xack(stream, GROUP, done_id)
    handle = await start_worker(consumer_idle_ms=1500, block_ms=100, **RECLAIM)  # a clean-up every 10 scans = 1 s

    async def ghost_gone() -> bool:
        return "ghost" not in {c["name"].decode() for c in await redis_client.xinfo_consumers(stream, GROUP)}

    # The scan counts a removal once DELCONSUMER's reply is back, a moment after Redis has already
    # dropped the consumer: wait for the count, then check Redis agrees.
    await wait_until(lambda: handle.worker.reclaimer.consumers_removed == 1, 6)
    assert await ghost_gone()
