"""Each forward on its own timeout, scaled from full-window forwards measured at warmup, and
decoding under a timeout of its own (worker/health/hang.py), with real worker processes and Redis."""

from __future__ import annotations

import json
import time

import pytest
import redis.asyncio as aioredis

from tests.helpers import Stack, wait_until
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import ENTRY_FIELD, ReplyMessage, RequestId, RequestMessage

WORDS = 64  # the synthetic model's window here (params.max_tokens): an input of 64 words costs 64


async def queue(redis: aioredis.Redis, key_prefix: str, inputs: list[object], *, read_by: str | None = None) -> str:
    """Queue one request on synthetic's stream (as the gateway does), its replies to a stream of
    the test's; with `read_by`, read it as that consumer, so it is that consumer's pending entry
    (what a worker that died holding it leaves). Returns the reply stream."""
    keys, reply_to = Keys(key_prefix), f"{key_prefix}:test-replies"
    await redis.xadd(reply_to, {"opened": "1"})  # workers reply with NOMKSTREAM
    if not await redis.exists(keys.request_stream("synthetic")):  # else the worker made it
        await redis.xgroup_create(keys.request_stream("synthetic"), GROUP, id="0", mkstream=True)
    now = now_ms()
    message = RequestMessage(request_id=RequestId("r1"), model="synthetic", inputs=inputs, reply_to=reply_to,
                             deadline_ms=now + 120_000, enqueued_ms=now)
    await redis.xadd(keys.request_stream("synthetic"), {ENTRY_FIELD: message.encode()})
    if read_by is not None:
        await redis.xreadgroup(GROUP, read_by, {keys.request_stream("synthetic"): ">"}, count=1)
    return reply_to


@pytest.mark.slow
async def test_a_reclaimed_request_of_many_long_forwards_is_served_not_taken_for_a_hang(
    stack: Stack, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    """1. A request of 32 inputs of 64 words each is pending for consumer test-worker-0, as if its
       worker died holding it. The synthetic model (max_batch_size 8, its window 64 words, no
       memory plan) takes 5.5 ms per unit of padded cost: 2.8 s per forward of 8 full-window
       inputs, 11.3 s for all four; its warmup examples (two one-word inputs) take 11 ms.
    2. test-worker-0 starts again: it takes back its pending entry and serves it whole, alone.
    Result: the caller gets its 32 outputs and the worker keeps running. (Before, the one timeout
    covering all four forwards, derived from the warmup, was its 10 s floor: the worker exited
    "forward hung" on each delivery and the request went to the dead letter.)"""
    text = " ".join(["w"] * WORDS)
    reply_to = await queue(redis_client, key_prefix, [f"{i} {text}" for i in range(32)], read_by="test-worker-0")
    worker = stack.start_worker(model="synthetic", memory_planner="false", models__synthetic__max_batch_size=8,
                                models__synthetic__params=json.dumps({"max_tokens": WORDS, "item_ms": 5.5}))
    replies: list[ReplyMessage] = []

    async def answered() -> bool:
        assert worker.poll() is None, stack.logs()
        replies.extend(r for _id, f in await redis_client.xrange(reply_to) for r in ReplyMessage.from_entry(f))
        return bool(replies)

    await wait_until(answered, 90, interval_s=0.2)
    (reply,) = replies
    assert reply.ok and reply.outputs == [f"{i} {text}" for i in range(32)], reply
    assert worker.poll() is None


async def test_a_decode_that_never_returns_restarts_the_worker(
    stack: Stack, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    """1. A synthetic worker (fault injection on, forward_timeout_s 2, which decodes take too) is ready.
    2. A request whose decoding never returns arrives (a stuck image decoder).
    Result: the worker logs "decode hung" with the request id and exits 8 (FORWARD_HUNG) for a
    restart; the request stays pending, to be reclaimed. (Before, the worker kept its heartbeat
    with its model thread stuck for good, and nothing restarted it.)"""
    worker = stack.start_worker(model="synthetic", fault_injection="true", models__synthetic__forward_timeout_s=2)
    beat = Keys(key_prefix).heartbeat("test-worker-0")
    await wait_until(lambda: redis_client.exists(beat), 90)
    await queue(redis_client, key_prefix, [{"fault": "decode_hang"}])
    started = time.monotonic()
    await wait_until(lambda: worker.poll() is not None, 30, interval_s=0.2)
    assert worker.returncode == 8, stack.logs()
    assert time.monotonic() - started < 20
    hung = [line for line in (stack.log_dir / "worker-0.log").read_text().splitlines() if '"decode hung' in line]
    assert len(hung) == 1 and '"r1"' in hung[0], hung
