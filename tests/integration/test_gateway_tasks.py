"""The gateway's long-lived tasks against a real Redis that misbehaves: a gateway process talks to
Redis through a fault proxy (tests/proxy.py) while a real synthetic worker talks to it directly.
Every error redis-py can raise is injected into each task (reply reader, keepalive, health refresh,
clock sync) and each task goes on; a recreated reply stream is read from its start; a clock
sample with a long round trip is not used; per-model readiness; a SIGTERM that keeps serving."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn

from tests.helpers import RedisServer, Stack, free_port, wait_until
from tests.integration.conftest import EDGE_PREFIX
from tests.proxy import STALL, FaultProxy
from tests.redis_faults import all_faults
from vramguard.gateway.__main__ import DrainingServer
from vramguard.gateway.app import broken_task, create_app
from vramguard.gateway.edge.server import uvicorn_options
from vramguard.shared.settings import Settings

PREFIX = EDGE_PREFIX


@pytest.fixture(scope="module")
def proxy(edge_proxy: FaultProxy) -> FaultProxy:
    return edge_proxy


@pytest.fixture(scope="module")
def stack(edge_stack: Stack) -> Stack:
    """conftest.py's edge_stack: a gateway through the proxy serving minilm (no worker), synthetic
    (a worker, direct to Redis) and two more models."""
    return edge_stack


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        yield http


@pytest.fixture
async def direct(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_server.url)
    yield connection
    await connection.aclose()


async def served(client: httpx.AsyncClient, value: int, timeout_ms: int = 3000) -> bool:
    response = await client.post("/v1/models/synthetic/infer", json={"inputs": [value], "timeout_ms": timeout_ms})
    return response.status_code == 200 and response.json()["outputs"] == [value]


async def reply_stream(direct: aioredis.Redis) -> bytes:
    keys = [key async for key in direct.scan_iter(f"{PREFIX}:rep:*")]
    assert len(keys) == 1, keys
    return keys[0]


async def test_readiness_is_the_gateways_and_per_model_readiness_stays_on_the_model_routes(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    """minilm has no worker, synthetic has one: the gateway is ready (it can serve synthetic) and
    says what minilm lacks; minilm's own readiness, native and v2, is 503 and synthetic's 200."""
    ready = await client.get("/health/ready")
    assert ready.status_code == 200, ready.text
    models = ready.json()["models"]
    assert models["synthetic"]["ready"] and not models["minilm"]["ready"]
    assert models["minilm"]["reasons"] == ["no live worker"]
    assert (await client.get("/v2/health/ready")).status_code == 200
    for path in ("/v1/models/{}/ready", "/v2/models/{}/ready"):
        assert (await client.get(path.format("minilm"))).status_code == 503
        assert (await client.get(path.format("synthetic"))).status_code == 200
    assert (await client.post("/v1/models/minilm/infer", json={"inputs": ["a"]})).status_code == 503


@pytest.mark.slow
async def test_a_model_whose_workers_cannot_start_is_reported_with_their_reason(
    stack: Stack, client: httpx.AsyncClient
) -> None:
    """A worker of `broken` (its package is not installed) exits at start. Result: the gateway stays
    ready (synthetic can be served); broken's readiness names the worker, its exit code and the
    error it exited with (today: only "no live worker", and the gateway was not ready at all)."""
    worker = stack.start_worker(model="broken")
    assert worker.wait(timeout=60) != 0

    async def reported() -> bool:
        reasons = (await client.get("/v1/models/broken/ready")).json()["reasons"]
        return any("failed to start" in r and "no_such_package" in r for r in reasons)

    await wait_until(reported, 10)
    assert (await client.get("/health/ready")).status_code == 200


async def test_a_recreated_reply_stream_is_read_from_its_start(
    stack: Stack, client: httpx.AsyncClient, direct: aioredis.Redis
) -> None:
    """1. The reader has read an entry whose id is far ahead (the old server's clock ran ahead).
    2. Redis loses the data (every key of the stack deleted) and the stream is recreated, its ids
       from the present: below the old last id.
    Result: requests are answered again (today's reader skipped every reply: 504 for ever)."""
    assert await served(client, 1)
    stream = await reply_stream(direct)
    await direct.xadd(stream, {b"init": b"1"}, id="9999999999999-0")

    async def read() -> bool:  # the reader deletes what it has read
        return not await direct.xrange(stream, min="9999999999999-0")

    await wait_until(read, 10)
    await direct.delete(*[key async for key in direct.scan_iter(f"{PREFIX}:*")])
    await wait_until(lambda: served(client, 2, timeout_ms=2000), 30, interval_s=0.2)


@pytest.mark.slow
async def test_every_redis_error_in_every_long_lived_task_is_survived(
    stack: Stack, proxy: FaultProxy, client: httpx.AsyncClient, direct: aioredis.Redis
) -> None:
    """Each fault of tests/redis_faults.py (every error class of redis-py's table, a cut, a stall,
    garbage, replies of the wrong shape) is injected, through the proxy, into the reply reader
    (XREAD, one at a time between good reads so its back-off stays short), the reply-stream
    keepalive (EXPIRE), the health refresh (ZREMRANGEBYSCORE) and the clock sync (TIME).
    Result: the gateway process still runs, answers requests, is ready, refreshes its reply
    stream's TTL and syncs its clock. (Today a reply of the wrong shape ends the reader.)"""
    faults = all_faults()
    for command in (b"EXPIRE", b"ZREMRANGEBYSCORE", b"TIME"):
        proxy.inject(command, faults)
    for fault in faults:  # the reader: each fault, then a good read
        before = proxy.served.get(b"XREAD", 0)
        proxy.inject(b"XREAD", [fault])
        await wait_until(lambda b=before: proxy.pending(b"XREAD") == 0 and proxy.served.get(b"XREAD", 0) > b,  # type: ignore[misc]
                         20 if fault == STALL else 10, interval_s=0.02)
    for command in (b"EXPIRE", b"ZREMRANGEBYSCORE", b"TIME"):
        await wait_until(lambda c=command: proxy.pending(c) == 0, 60, interval_s=0.1)  # type: ignore[misc]
    time_samples = proxy.served.get(b"TIME", 0)
    assert stack.gateway is not None and stack.gateway.poll() is None
    await wait_until(lambda: served(client, 3), 15, interval_s=0.2)
    await wait_until(lambda: ready(client), 10)
    stream = await reply_stream(direct)
    await direct.expire(stream, 10_000)
    await wait_until(lambda: ttl_below(direct, stream, 100), 10)  # the keepalive set it back to 60 s
    await wait_until(lambda: proxy.served.get(b"TIME", 0) > time_samples, 15)  # the clock sync goes on
    assert stack.gateway.poll() is None


async def ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health/ready")).status_code == 200


async def ttl_below(direct: aioredis.Redis, key: bytes, limit_s: int) -> bool:
    return 0 < await direct.ttl(key) < limit_s


async def test_a_clock_sample_with_a_long_round_trip_is_not_used(
    stack: Stack, proxy: FaultProxy, client: httpx.AsyncClient
) -> None:
    """Redis' TIME replies are held 1 s (a stall): a sample taken so would put the gateway's
    clock 500 ms behind (the midpoint of the round trip). Result: the gateway logs that no good
    sample was available and its clock (status.json's time_ms, on the shared clock) stays within
    200 ms of this host's (same host: the true offset is 0)."""
    log = Path(stack.log_dir / "gateway.log")
    seen = len(log.read_text())  # this module's gateway is shared: only what it logs from now on counts
    proxy.delay_replies(b"TIME", 1.0)
    try:
        await wait_until(lambda: "no clock sample with a small round trip" in log.read_text()[seen:], 20,
                         interval_s=0.2)
        before = time.time() * 1000
        shared_ms = (await client.get("/status.json")).json()["time_ms"]
        after = time.time() * 1000
        assert before - 200 < shared_ms < after + 200, (shared_ms - (before + after) / 2)
    finally:
        proxy.delay_replies(b"TIME", 0)


async def test_sigterm_keeps_serving_through_the_delay_then_drains(
    stack: Stack, client: httpx.AsyncClient, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A second gateway of the stack (shutdown_delay_s 2.5) gets SIGTERM.
    Result: during the delay /health/ready is 503 but new connections are accepted and requests
    answered 200 (today: 503 at once); then it drains and exits 0."""
    second = Stack(redis_server.url, tmp_path, **{**stack.settings, "shutdown_delay_s": 2.5})
    second.start_gateway()
    second.models.add("synthetic")
    try:
        await second.wait_ready(60)
        assert second.gateway is not None
        second.gateway.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        async with httpx.AsyncClient(base_url=second.url, timeout=10,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
            await wait_until(lambda: status_of(fresh, "/health/ready", 503), 2, interval_s=0.05)
            answered = [await served(fresh, i) for i in range(3)]
            assert time.monotonic() - sent < 2.5, "the requests took past the delay; nothing was checked"
            assert answered == [True] * 3
        assert second.gateway.wait(timeout=20) == 0
    finally:
        second.stop()


async def status_of(client: httpx.AsyncClient, path: str, code: int) -> bool:
    return (await client.get(path)).status_code == code


@pytest.mark.slow
async def test_open_routes_give_a_generic_redis_reason_and_the_detail_needs_the_api_key(tmp_path: Path) -> None:
    """A gateway whose Redis refuses connections: /health/ready and /status.json (open) say Redis is
    unreachable without its address or error text (which name internal hosts); with the API key
    the detail is there."""
    dead_port = free_port()
    lone = Stack(f"redis://127.0.0.1:{dead_port}/0", tmp_path, key_prefix="lone", served_models="synthetic",
                 api_key="secret-key")
    lone.start_gateway()
    try:
        async with httpx.AsyncClient(base_url=lone.url, timeout=10) as http:
            await wait_until(lambda: answers(http, "/health/ready"), 60, interval_s=0.2)
            for path in ("/health/ready", "/status.json"):
                open_text = (await http.get(path)).text
                assert "redis: unreachable or failing" in open_text, open_text
                assert str(dead_port) not in open_text and "refused" not in open_text.lower(), open_text
                keyed = (await http.get(path, headers={"X-API-Key": "secret-key"})).text
                assert str(dead_port) in keyed, keyed
    finally:
        lone.stop()


async def answers(http: httpx.AsyncClient, path: str) -> bool:
    try:
        return (await http.get(path)).status_code in (200, 503)
    except httpx.HTTPError:
        return False


class TaskKilled(BaseException):
    """Not an Exception: escapes every handler in the gateway's tasks."""


async def test_a_long_lived_task_that_ends_fails_readiness_and_stops_the_server(redis_server: RedisServer) -> None:
    """The gateway's server (uvicorn, real HTTP, as python -m vramguard.gateway runs it) loses its
    reply reader: its next read raises a BaseException, which no handler of a Redis error catches
    (no Redis error ends it any more; this stands for a bug). Result: the server stops by itself,
    readiness names the task, and the exit code main() returns is 1, so it is restarted."""
    settings = Settings(redis_url=redis_server.url, key_prefix="ends", served_models=["synthetic"],
                        port=free_port(), host="127.0.0.1", block_ms=200)
    app = create_app(settings)
    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                                           **uvicorn_options(settings)), app)  # type: ignore[arg-type]
    serving = asyncio.ensure_future(server.serve())
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.port}") as http:
        await wait_until(lambda: answers(http, "/health/live"), 30)
    async def read_and_die(*args: object, **kwargs: object) -> None:
        raise TaskKilled

    app.state.listener._blocking.xread = read_and_die  # the next read, after the one under way (200 ms)
    await asyncio.wait_for(serving, 30)
    assert broken_task(app) is not None and "reply-reader" in broken_task(app)
    ready, details = app.state.health.readiness()
    assert not ready and any("reply-reader" in r for r in details["reasons"]), details
