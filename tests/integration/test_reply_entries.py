"""A batch's replies reach each gateway as one reply-stream entry (one XADD per gateway per
batch, not per request), and a gateway resolves every waiting request from such an entry; an
entry of replies it cannot decode is dropped and logged, and the gateway goes on answering."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.helpers import wait_until
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ENTRY_FIELD, REPLIES_FIELD, ReplyMessage, RequestId, RequestMessage


async def test_one_batch_answers_each_gateway_with_one_entry(redis_client, start_worker, key_prefix) -> None:
    """1. Six requests in one MULTI, so the worker reads them as one batch: four answer to
       gateway a, two to gateway b.
    Result: a's stream holds one entry carrying its four replies in request order, b's one
    entry carrying its two."""
    keys = Keys(key_prefix)
    stream = keys.request_stream("synthetic")
    to_a, to_b = keys.reply_stream("a"), keys.reply_stream("b")
    for reply_to in (to_a, to_b):
        await redis_client.xadd(reply_to, {b"init": b"1"})  # workers write with NOMKSTREAM
    handle = await start_worker(models={"synthetic": {"max_batch_size": 8, "max_wait_ms": 50}})
    targets = [to_a, to_b, to_a, to_a, to_b, to_a]
    async with redis_client.pipeline(transaction=True) as pipe:
        for i, reply_to in enumerate(targets):
            msg = RequestMessage(RequestId(f"r{i}"), "synthetic", [i], reply_to, now_ms() + 30_000, now_ms())
            pipe.xadd(stream, {ENTRY_FIELD: msg.encode()})
        await pipe.execute()

    async def entries(reply_to: str) -> list[dict[bytes, bytes]]:
        return [fields for _id, fields in await redis_client.xrange(reply_to) if b"init" not in fields]

    async def answered() -> bool:
        return bool(await entries(to_a) and await entries(to_b))

    await wait_until(answered, 10)
    assert handle.worker.stats.batches == 1
    (a_entry,), (b_entry,) = await entries(to_a), await entries(to_b)
    assert set(a_entry) == {REPLIES_FIELD} and set(b_entry) == {REPLIES_FIELD}
    assert [(r.request_id, r.outputs) for r in ReplyMessage.from_entry(a_entry)] == [
        ("r0", [0]), ("r2", [2]), ("r3", [3]), ("r5", [5])]
    assert [(r.request_id, r.outputs) for r in ReplyMessage.from_entry(b_entry)] == [("r1", [1]), ("r4", [4])]


async def test_the_gateway_answers_a_batch_from_one_entry_and_drops_an_undecodable_one(
    gateway, start_worker, redis_client, caplog: pytest.LogCaptureFixture
) -> None:
    """1. An entry of replies that is not msgpack lands on the gateway's reply stream.
    2. Eight requests arrive in one batch window.
    Result: the bad entry is logged and dropped; all eight get their own outputs."""
    handle = await start_worker(models={"synthetic": {"max_batch_size": 8, "max_wait_ms": 300}})

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    await redis_client.xadd(gateway.app.state.listener.stream, {REPLIES_FIELD: b"\xc1not msgpack"})
    with caplog.at_level(logging.ERROR, logger="vramguard.gateway.admission.replies"):
        responses = await asyncio.gather(*(
            gateway.post("/v1/models/synthetic/infer", json={"inputs": [f"x{i}"]}) for i in range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    assert [r.json()["outputs"] for r in responses] == [[f"x{i}"] for i in range(8)]
    assert handle.worker.stats.max_batch_seen > 1  # some replies did share an entry
    assert any(rec.getMessage() == "undecodable reply dropped" for rec in caplog.records)
