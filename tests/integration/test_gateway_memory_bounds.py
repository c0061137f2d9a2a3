"""What one client's bytes may take: a model's queue is bounded in bytes in Redis (not only in
entries) and a gateway process in the request body bytes it holds at once; past either bound the
client gets 429 / 503 with the reason, and serving goes on once the bytes are gone. Against the
gateway process of conftest.py's edge_stack: synthetic's queue_bound_bytes is 10 MiB, the
gateway's max_inflight_body_bytes 20 MiB."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio

from tests.helpers import Stack, wait_until
from tests.integration.conftest import EDGE_PREFIX
from vramguard.shared.keys import Keys

MIB = 2**20


@pytest.fixture(scope="module")
def stack(edge_stack: Stack) -> Stack:
    return edge_stack


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        yield http


async def test_a_models_queue_is_bounded_in_bytes(stack: Stack, client: httpx.AsyncClient) -> None:
    """The synthetic worker is stopped (SIGSTOP; expected back, so the gateway still admits). Two
    requests of 3 MiB and a small one wait in its queue; more 3 MiB requests are sent until one gets
    429 queue_full naming the bytes and the bound (10 MiB: at most two more fit; today every one was
    queued, only entries were counted). Continued, the worker answers the three that waited."""
    worker = stack.workers[0]
    big = {"inputs": ["x" * (3 * MIB)], "timeout_ms": 60_000}
    worker.send_signal(signal.SIGSTOP)
    try:
        waiting = [asyncio.ensure_future(client.post("/v1/models/synthetic/infer", json=body))
                   for body in (big, big, {"inputs": [1], "timeout_ms": 60_000})]
        await wait_until(lambda: queued(stack, 3), 30)
        statuses = []
        for _ in range(4):  # 10 MiB hold at most 3 such entries besides the small one
            refused = await client.post("/v1/models/synthetic/infer", json={**big, "timeout_ms": 1000})
            statuses.append(refused.status_code)
            if refused.status_code == 429:
                break
        assert statuses[-1] == 429, statuses  # the others were admitted (their 504 comes at 1 s)
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "queue_bound_bytes" in error["message"], error
        assert refused.headers["Retry-After"] == "1"
        assert not any(w.done() for w in waiting), [w.result().text[:200] for w in waiting if w.done()]
    finally:
        worker.send_signal(signal.SIGCONT)
    answers = await asyncio.gather(*waiting)
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text[:200] for a in answers]


async def queued(stack: Stack, entries: int) -> bool:
    async with redis.asyncio.Redis.from_url(stack.redis_url) as direct:
        return int(await direct.xlen(Keys(EDGE_PREFIX).request_stream("synthetic"))) == entries


async def slow_upload(port: int, length: int) -> socket.socket:
    """A connection that sent its headers and the first byte of a `length`-byte JSON body, then stalls."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/models/synthetic/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n{{".encode())
    return sock


async def test_a_gateway_bounds_the_body_bytes_it_holds(stack: Stack, client: httpx.AsyncClient) -> None:
    """Two uploads of 8 MiB bodies stall after their first byte (16 MiB of the 20 held). Result: a
    third 8 MiB body gets 503 unavailable naming the bound, before its body is read (today every
    one is read: 1,000 of them exceed a 1 GiB pod); a small request still passes; once the stalled
    uploads are gone, an 8 MiB body is read again."""
    body = json.dumps({"inputs": ["x" * (8 * MIB - 100)], "timeout_ms": 2000})
    stalled = [await slow_upload(stack.port, len(body)) for _ in range(2)]
    try:
        async def refused() -> bool:
            response = await client.post("/v1/models/synthetic/infer", content=body,
                                         headers={"Content-Type": "application/json"})
            return response.status_code == 503 and "max_inflight_body_bytes".upper() in response.text.upper()

        await wait_until(refused, 10, interval_s=0.2)
        small = await client.post("/v1/models/synthetic/infer", json={"inputs": [1]})
        assert small.status_code == 200, small.text
    finally:
        for sock in stalled:
            sock.close()

    async def read_again() -> bool:
        response = await client.post("/v1/models/synthetic/infer", content=body,
                                     headers={"Content-Type": "application/json"})
        return response.status_code != 503

    await wait_until(read_again, 10, interval_s=0.2)
