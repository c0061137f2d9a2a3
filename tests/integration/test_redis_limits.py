"""Redis refusing writes, and Redis that may delete our keys: a demoted primary (READONLY) is a
reason to reconnect, not a permanent error; a Redis at maxmemory (OOM) gives clients 503 naming
the cause while what was accepted survives; a read-only replica is named in readiness and in the
503; an evicting maxmemory-policy is caught at start and when set at run time, and keys lost to
eviction are reported as eviction, not as a restart."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ReadOnlyError

from tests.helpers import RedisServer, gateway_with, wait_until
from vramguard.shared.redis_client import check_eviction_policy, connect, describe_data_loss
from vramguard.shared.settings import Settings


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this module's own: these tests change its configuration and replication."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def admin(own_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(own_redis.url)
    yield client
    await client.config_set("maxmemory", 0)
    await client.config_set("maxmemory-policy", "noeviction")
    await client.execute_command("REPLICAOF", "NO", "ONE")
    await client.flushdb()
    await client.aclose()


@pytest.fixture
def fast_settings(fast_settings: dict[str, object], own_redis: RedisServer) -> dict[str, object]:
    # Quick reclaim, so that a batch whose replies could not be written is served again soon.
    return {**fast_settings, "redis_url": own_redis.url, "claim_idle_ms": 1000, "reclaim_interval_ms": 200}


async def test_readonly_primary_is_retried_on_a_fresh_connection(admin, settings_factory) -> None:
    client = connect(settings_factory())
    await client.set("k", "1")
    # Demote it: a replica of a port where nothing listens keeps its data and refuses writes.
    await admin.execute_command("REPLICAOF", "127.0.0.1", "1")
    started = time.monotonic()
    with pytest.raises(ReadOnlyError):
        await client.set("k", "2")
    assert time.monotonic() - started < 5  # bounded retries, then the error (a 503 at the gateway)

    async def promote_soon() -> None:
        await asyncio.sleep(0.3)
        await admin.execute_command("REPLICAOF", "NO", "ONE")

    # Promoted again while the write is being retried: the retry on a new connection succeeds.
    _, result = await asyncio.gather(promote_soon(), client.set("k", "3"))
    assert result is True and await admin.get("k") == b"3"
    await client.aclose()


@pytest.mark.slow
async def test_oom_gives_503_naming_the_cause_and_keeps_what_was_accepted(
    admin, gateway, start_worker
) -> None:
    await start_worker(models={"synthetic": {"params": {"batch_ms": 1500}}})

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    accepted = asyncio.create_task(
        gateway.post("/v1/models/synthetic/infer", json={"inputs": [1], "timeout_ms": 20_000}))
    await asyncio.sleep(0.5)  # in its forward now
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used // 2)  # over the limit: every write is refused
    refused = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [2], "timeout_ms": 10_000})
    assert refused.status_code == 503, refused.text
    assert "out of memory" in refused.json()["error"]["message"]
    await asyncio.sleep(1.5)  # the forward ends; its reply cannot be written, the entry stays pending
    await admin.config_set("maxmemory", 0)  # memory frees
    first = await accepted
    assert first.status_code == 200 and first.json()["outputs"] == [1], first.text
    again = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [3], "timeout_ms": 10_000})
    assert again.status_code == 200


async def test_evicting_policy_is_named_at_start_or_refused(admin, settings_factory, caplog) -> None:
    client = connect(settings_factory())
    assert await check_eviction_policy(client, settings_factory()) is None
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    with caplog.at_level(logging.ERROR, logger="vramguard.shared.redis_client"):
        problem = await check_eviction_policy(client, settings_factory())
    assert problem is not None and "allkeys-lru" in problem and "noeviction" in problem
    assert any("allkeys-lru" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="allkeys-lru"):
        await check_eviction_policy(client, settings_factory(redis_eviction_check="refuse"))
    await client.aclose()


async def test_keys_lost_to_eviction_are_reported_as_eviction(admin, own_redis) -> None:
    client = connect(Settings(redis_url=own_redis.url))
    assert "restarted" in await describe_data_loss(client)
    await admin.config_set("maxmemory-policy", "allkeys-random")
    await admin.config_set("maxmemory", int((await admin.info("memory"))["used_memory"]) + 200_000)
    for i in range(100):
        await admin.set(f"filler:{i}", b"x" * 10_000)
    message = await describe_data_loss(client)
    assert "evicted" in message and "maxmemory-policy" in message
    await client.aclose()


async def test_a_read_only_redis_is_named_in_readiness_and_in_the_503(admin, gateway) -> None:
    """1. The gateway's Redis becomes a replica (REPLICAOF a port where nothing listens): it keeps
    its data and refuses writes (replica-read-only). Result: /health/ready says 503 naming it,
    without the API key too, and a request's 503 names it (it used to say "unreachable")."""
    await admin.execute_command("REPLICAOF", "127.0.0.1", "1")

    async def named() -> bool:
        response = await gateway.get("/health/ready")
        return response.status_code == 503 and any("read-only" in r for r in response.json()["reasons"])

    await wait_until(named, 30)
    refused = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [1], "timeout_ms": 10_000})
    assert refused.status_code == 503 and "read-only replica" in refused.json()["error"]["message"], refused.text


@pytest.mark.parametrize("check", ["warn", "refuse"])
async def test_an_evicting_policy_set_at_run_time_is_named_in_readiness_and_in_the_503(
        admin, settings_factory, start_worker, check: str) -> None:
    """1. A gateway and a worker run on a Redis under noeviction.
    2. `CONFIG SET maxmemory-policy allkeys-lru` while they run.
    Result: readiness names the policy, as a warning (VRAMGUARD_REDIS_EVICTION_CHECK=warn: still
    serving) or as a reason (refuse: 503, and each request's 503 names it)."""
    await start_worker()
    async with gateway_with(settings_factory(redis_eviction_check=check)) as gateway:
        await wait_until(lambda: ready(gateway), 30)
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        field = "warnings" if check == "warn" else "reasons"

        async def named() -> bool:
            details = (await gateway.get("/health/ready")).json()
            return any("allkeys-lru" in r for r in details[field])

        await wait_until(named, 30)
        answer = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [1], "timeout_ms": 10_000})
        if check == "warn":
            assert answer.status_code == 200 and await ready(gateway), answer.text
        else:
            assert answer.status_code == 503 and "allkeys-lru" in answer.json()["error"]["message"], answer.text


async def ready(gateway: httpx.AsyncClient) -> bool:
    return (await gateway.get("/health/ready")).status_code == 200
