"""gateway/admission/coalesce.py against a real redis-server: script calls made together share one
pipelined round trip (those of one loop pass, and those made while a round trip is in flight),
each gets its own result or error, a flushed script cache is reloaded, a failed round trip
reaches every caller, a stalled one holds the others back only briefly, and a call nobody waits
for any more is not sent."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError

from tests.helpers import RedisServer, free_port
from tests.proxy import LossyProxy
from vramguard.gateway.admission import coalesce
from vramguard.gateway.admission.coalesce import ScriptBatcher
from vramguard.shared.redis_client import connect

ECHO_OR_FAIL = "if ARGV[1] == 'fail' then return redis.error_reply('refused') end return ARGV[1]"
CALLS = 20


async def test_calls_of_one_loop_pass_share_one_connection_and_keep_their_order(redis_server: RedisServer) -> None:
    name = f"coalesce-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(redis_server.url, client_name=name)
    try:
        batcher = ScriptBatcher(client)
        script = client.register_script(ECHO_OR_FAIL)
        futures = [batcher.call(script, [f"k{i}"], [str(i) if i != 7 else "fail"]) for i in range(CALLS)]
        results = await asyncio.gather(*futures)
        # 1. Each call its own result, in order; the failing one its own error, the rest unharmed.
        assert [r for i, r in enumerate(results) if i != 7] == [str(i).encode() for i in range(CALLS) if i != 7]
        assert isinstance(results[7], ResponseError) and "refused" in str(results[7])
        # 2. Twenty concurrent calls went out on one connection: one round trip, not twenty.
        clients = await client.client_list()
        assert sum(1 for c in clients if c.get("name") == name) == 1
    finally:
        await client.aclose()


async def test_a_flushed_script_cache_is_reloaded_and_each_call_runs_once(redis_client: aioredis.Redis) -> None:
    key = f"coalesce-{uuid.uuid4().hex[:8]}"
    script = redis_client.register_script("return redis.call('INCR', KEYS[1])")
    batcher = ScriptBatcher(redis_client)
    await redis_client.script_flush()
    results = await asyncio.gather(*(batcher.call(script, [key], []) for _ in range(3)))
    assert sorted(results) == [1, 2, 3]  # loaded once, each call ran exactly once
    assert int(await redis_client.get(key)) == 3


async def test_identical_idempotent_calls_of_one_pass_run_once_in_the_first_callers_place(
        redis_client: aioredis.Redis) -> None:
    """The reply-stream check's case: several admissions of one round trip ask for the same
    idempotent call; it runs once, before the calls queued after its first caller, and every
    caller gets its result. Plain calls with the same arguments still run each time, and the
    next round trip runs the idempotent call again."""
    key = f"coalesce-{uuid.uuid4().hex[:8]}"
    count = redis_client.register_script("return redis.call('INCR', KEYS[1])")
    read = redis_client.register_script("return redis.call('GET', KEYS[1])")
    batcher = ScriptBatcher(redis_client)
    futures = []
    for _ in range(5):  # as each admission queues: the shared check, then its own call
        futures += [batcher.call(count, [key], [], idempotent=True), batcher.call(read, [key], [])]
    results = await asyncio.gather(*futures)
    assert results[0::2] == [1] * 5  # one INCR, its result to all five callers
    assert results[1::2] == [b"1"] * 5  # every read ran after it
    assert await batcher.call(count, [key], [], idempotent=True) == 2  # a new pass: runs again
    plain = await asyncio.gather(*(batcher.call(count, [key], []) for _ in range(3)))
    assert sorted(plain) == [3, 4, 5]


async def test_a_failed_round_trip_reaches_every_caller() -> None:
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5)  # nothing listens there
    try:
        batcher = ScriptBatcher(client)
        script = client.register_script(ECHO_OR_FAIL)
        futures = [batcher.call(script, ["k"], [str(i)]) for i in range(3)]
        for future in futures:
            with pytest.raises(RedisConnectionError):
                await future
    finally:
        await client.aclose()


async def test_a_demoted_primary_is_left_and_the_calls_retried_until_one_is_promoted(settings_factory) -> None:  # type: ignore[no-untyped-def]
    """A Redis turned replica (READONLY, as a Sentinel failover demotes the old primary) and
    promoted back 0.3 s later: the calls of the pipeline that met READONLY are sent again
    through the client's retries and succeed, once each."""
    server = RedisServer()
    server.start()
    client = connect(settings_factory(redis_url=server.url))
    try:
        key = f"coalesce-{uuid.uuid4().hex[:8]}"
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        await script(keys=[key])  # loaded while still a primary
        await client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # nothing there: stays a replica

        async def promote() -> None:
            await asyncio.sleep(0.3)
            admin = aioredis.Redis.from_url(server.url)
            await admin.execute_command("REPLICAOF", "NO", "ONE")
            await admin.aclose()

        batcher = ScriptBatcher(client)
        results, _ = await asyncio.gather(asyncio.gather(*(batcher.call(script, [key], []) for _ in range(3))),
                                          promote())
        assert sorted(results) == [2, 3, 4]
    finally:
        await client.aclose()
        server.stop()


async def test_a_replica_that_stays_one_gets_its_error_back_after_the_retries(settings_factory) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer()
    server.start()
    client = connect(settings_factory(redis_url=server.url))
    try:
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        await script(keys=["k"])
        await client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        (result,) = await asyncio.wait_for(asyncio.gather(ScriptBatcher(client).call(script, ["k"], [])), 10)
        # Redis 7 answers READONLY itself (redis-py's ReadOnlyError); Redis 6 wraps it in the script's error
        assert isinstance(result, ReadOnlyError) or (isinstance(result, ResponseError) and "READONLY" in str(result))
    finally:
        await client.aclose()
        server.stop()


# One item per call: returns each item's ARGV after the leading one, with the call's item count.
ITEMS = "local out = {} for i = 2, #ARGV do out[#out + 1] = {ARGV[i], #ARGV - 1} end return out"


async def test_calls_made_while_a_round_trip_is_in_flight_go_together_in_the_next_one(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: while one round trip waits on Redis (held by CLIENT PAUSE WRITE, which holds
    scripts), the calls made in three later loop passes are not sent one pass at a time; they go
    as ONE grouped call once it is answered. A call made when nothing is in flight is sent at once."""
    monkeypatch.setattr(coalesce, "STALL_S", 5.0)  # a slow test machine's pause is not a stall here
    client = aioredis.Redis.from_url(redis_server.url)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        batcher = ScriptBatcher(client)
        key = f"coalesce-{uuid.uuid4().hex[:8]}"
        script = client.register_script(ITEMS)
        await script(keys=[key], args=["lead"])  # loaded before the pause
        await admin.execute_command("CLIENT", "PAUSE", "5000", "WRITE")
        first = batcher.call_grouped(script, [key], ["lead"], [], [b"a"])
        await asyncio.sleep(0.002)  # sent: the first round trip now waits on the paused Redis
        later = []
        for item in (b"b", b"c", b"d"):  # three loop passes apart, within STALL_S
            later.append(batcher.call_grouped(script, [key], ["lead"], [], [item]))
            await asyncio.sleep(0)
        assert batcher.round_trips == 1  # nothing more was sent while the first was in flight
        await admin.execute_command("CLIENT", "UNPAUSE")
        assert await first == [b"a", 1]
        assert await asyncio.gather(*later) == [[b"b", 3], [b"c", 3], [b"d", 3]]  # one call carried all three
        assert batcher.round_trips == 2
        assert await batcher.call_grouped(script, [key], ["lead"], [], [b"e"]) == [b"e", 1]
        assert batcher.round_trips == 3
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()
        await admin.aclose()


async def test_a_stalled_round_trip_holds_later_calls_back_for_stall_s_only(redis_server: RedisServer) -> None:
    """A round trip whose reply does not come (a proxy holds it for 1.5 s, then cuts the
    connection) does not hold the gateway's later calls for that long: after
    STALL_S they go on a round trip of their own, on another connection, and are answered while
    the stalled one still waits."""
    async with LossyProxy(redis_server.port, every=1, max_lost=1, delay_s=1.5) as proxy:
        client = aioredis.Redis.from_url(proxy.url, socket_timeout=10)
        try:
            batcher = ScriptBatcher(client)
            script = client.register_script(ITEMS)
            key = f"coalesce-{uuid.uuid4().hex[:8]}"
            await client.script_load(ITEMS)  # no EVALSHA: the proxy lets it through
            stalled = batcher.call_grouped(script, [key], ["lead"], [], [b"a"])
            await asyncio.sleep(0.05)
            later = batcher.call_grouped(script, [key], ["lead"], [], [b"b"])
            assert await asyncio.wait_for(later, 1.0) == [b"b", 1]  # well before the stalled reply
            assert not stalled.done()
            assert batcher.round_trips == 2
            (outcome,) = await asyncio.wait_for(asyncio.gather(stalled, return_exceptions=True), 10)
            assert outcome == [b"a", 1] or isinstance(outcome, RedisConnectionError)  # the cut, re-sent or not
        finally:
            await client.aclose()


async def test_an_item_whose_caller_stopped_waiting_is_left_out_of_its_call(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admissions queued behind a round trip whose callers give up (deadline, client gone: their
    futures are cancelled) before it is sent are not sent: the grouped call carries only the items
    still awaited, and a call with none left is not sent at all."""
    monkeypatch.setattr(coalesce, "STALL_S", 5.0)
    client = aioredis.Redis.from_url(redis_server.url)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        batcher = ScriptBatcher(client)
        script = client.register_script(ITEMS)
        key = f"coalesce-{uuid.uuid4().hex[:8]}"
        await script(keys=[key], args=["lead"])
        before = (await admin.info("commandstats"))["cmdstat_evalsha"]["calls"]
        await admin.execute_command("CLIENT", "PAUSE", "5000", "WRITE")
        first = batcher.call_grouped(script, [key], ["lead"], [], [b"a"])
        await asyncio.sleep(0.002)
        gone, kept = (batcher.call_grouped(script, [key], ["lead"], [], [item]) for item in (b"gone", b"kept"))
        alone = batcher.call_grouped(script, [f"{key}-2"], ["lead"], [], [b"alone"])  # a group of its own
        gone.cancel()
        alone.cancel()
        await admin.execute_command("CLIENT", "UNPAUSE")
        assert await first == [b"a", 1]
        assert await kept == [b"kept", 1]  # the call carried this item only
        assert batcher.round_trips == 2
        calls = (await admin.info("commandstats"))["cmdstat_evalsha"]["calls"] - before
        assert calls == 2  # the first and the one with "kept": none for "alone"
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()
        await admin.aclose()


async def test_calls_made_while_a_round_trip_fails_are_still_sent() -> None:
    """A failed round trip ends the wait of the calls made meanwhile: they are sent (and here fail
    too, nothing listens) instead of waiting forever behind it."""
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5)
    try:
        batcher = ScriptBatcher(client)
        script = client.register_script(ECHO_OR_FAIL)
        first = batcher.call(script, ["k"], ["1"])
        await asyncio.sleep(0)  # sent: the connection attempt is under way
        later = batcher.call(script, ["k"], ["2"])
        for future in (first, later):
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(future, 10)
        assert batcher.round_trips == 2
    finally:
        await client.aclose()
