"""gateway/coalesce.py against a real redis-server: script calls made in one loop pass share one
pipelined round trip, each gets its own result or error, a flushed script cache is reloaded,
and a failed round trip reaches every caller."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError

from tests.helpers import RedisServer, free_port
from vramguard.gateway.coalesce import ScriptBatcher
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
    """The reply-stream check's case: several admissions of one loop pass ask for the same
    idempotent call; it runs once, before the calls queued after its first caller, and every
    caller gets its result. Plain calls with the same arguments still run each time, and the
    next loop pass runs the idempotent call again."""
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
