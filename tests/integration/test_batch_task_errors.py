"""An exception inside a worker's batch task (outside the forward: a bug in our own code), with
real gateway and worker processes."""

from __future__ import annotations

import time

import httpx
import redis.asyncio as aioredis

from tests.helpers import Stack, wait_until
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ENTRY_FIELD, ReplyMessage, RequestId, RequestMessage


async def test_a_failing_batch_task_answers_500_internal_at_once(stack: Stack) -> None:
    """1. One synthetic worker (fault injection on; claim_idle_ms 10 s, the default) gets a
       request whose costing raises ({"fault": "internal"}).
    Result: the caller gets 500 `internal` well before any reclaim could happen; the worker logs
    "batch task failed" with the request id, counts it in
    vramguard_worker_batch_task_failures_total, and serves the next request."""
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", fault_injection="true")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        started = time.monotonic()
        reply = await client.post("/v1/models/synthetic/infer", json={"inputs": [{"fault": "internal"}]})
        elapsed_s = time.monotonic() - started
        body = reply.json()["error"]
        assert (reply.status_code, body["code"]) == (500, "internal"), body
        assert elapsed_s < 5.0  # claim_idle_ms is 10 s: answered by the worker, not by a reclaim
        assert (await client.post("/v1/models/synthetic/infer", json={"inputs": [1]})).status_code == 200

        async def counted() -> bool:
            text = (await client.get("/metrics")).text
            return any(line.startswith("vramguard_worker_batch_task_failures_total{") and line.endswith(" 1.0")
                       for line in text.splitlines())

        await wait_until(counted, 10)
    log = (stack.log_dir / "worker-0.log").read_text()
    failed = [line for line in log.splitlines() if '"batch task failed"' in line]
    assert len(failed) == 1 and body["request_id"] in failed[0]


async def test_a_failing_batch_of_entries_across_a_digit_boundary_is_answered_whole(
    stack: Stack, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    """1. One synthetic worker (fault injection on; a 300 ms batch window; claim_idle_ms 10 s, the
       default) and its gateway are ready.
    2. Four requests are added in one transaction with the ids a burst of admissions in one
       millisecond gets, 1000-8 ... 1000-11 (as text "1000-10" sorts before "1000-8"), each an
       input whose costing raises, so the worker's batch task fails with all four in its batch.
    Result: all four callers get 500 `internal` from the worker, well before any reclaim."""
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", fault_injection="true", models__synthetic__max_wait_ms=300)
    await stack.wait_ready()
    reply_to = f"{key_prefix}:test-replies"
    await redis_client.xadd(reply_to, {"opened": "1"})  # workers reply with NOMKSTREAM
    now = now_ms()
    ids = [f"1000-{seq}" for seq in range(8, 12)]
    async with redis_client.pipeline(transaction=True) as pipe:
        for seq, entry_id in enumerate(ids):
            message = RequestMessage(request_id=RequestId(f"burst-{seq}"), model="synthetic",
                                     inputs=[{"fault": "internal"}], reply_to=reply_to,
                                     deadline_ms=now + 30_000, enqueued_ms=now)
            pipe.xadd(Keys(key_prefix).request_stream("synthetic"), {ENTRY_FIELD: message.encode()}, id=entry_id)
        await pipe.execute()
    replies: dict[str, ReplyMessage] = {}
    last_id, until = "0", time.monotonic() + 8.0  # claim_idle_ms is 10 s: no reclaim answers these
    while len(replies) < len(ids) and time.monotonic() < until:
        for _stream, entries in await redis_client.xread({reply_to: last_id}, block=500) or ():
            for entry_id, fields in entries:
                last_id = entry_id
                for reply in ReplyMessage.from_entry(fields):
                    replies[reply.request_id] = reply
    assert sorted(replies) == [f"burst-{seq}" for seq in range(4)], stack.logs()
    assert {r.error_code for r in replies.values()} == {"internal"}
