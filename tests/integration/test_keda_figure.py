"""The figure the KEDA ScaledObject (deploy/k8s/base/scaledobject.yaml) scales the workers on,
read as KEDA reads it (tests/keda.py), against a real Redis 7 and three real worker processes
under overload."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from tests.ci import require_part
from tests.helpers import Stack, wait_until
from tests.keda import desired_replicas, figure, queue_figure, stream_triggers
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ENTRY_FIELD, ReplyMessage, RequestId, RequestMessage

WORKERS = 3
MAX_BATCH_SIZE = 4
STEPS = 5
REQUESTS_PER_STEP = 60  # three workers serve about 12 a second (4 per 1 s forward each)


async def test_the_scaled_objects_figure_grows_with_the_backlog_of_three_overloaded_workers(
    stack: Stack, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    """1. Three synthetic worker processes (4 items per 1 s forward each, about 12 requests/s
       together) on a Redis >= 7.
    2. Five times, half a second apart, 60 one-input requests are queued on the model's stream at
       once (as the gateway queues them): far more than the workers serve, so the backlog grows.
       After each step every trigger's figure is read as KEDA reads it, in one transaction with
       the count of replies so far, so the backlog (queued minus answered) is exact.
    Result: each figure equals the backlog (give or take the batches whose replies are being
    published), grows with it, and at the last step asks for more than the three workers."""
    version = (await redis_client.info("server"))["redis_version"]
    require_part(int(str(version).split(".")[0]) >= 7, f"Redis >= 7 (Debian's redis-server), not {version}")
    keys = Keys(key_prefix)
    for _ in range(WORKERS):
        stack.start_worker(model="synthetic", models__synthetic__max_batch_size=MAX_BATCH_SIZE,
                           models__synthetic__params='{"batch_ms": 1000}')

    async def all_ready() -> bool:
        return int(await redis_client.zcard(keys.worker_index("synthetic"))) == WORKERS

    await wait_until(all_ready, 90)
    stream, reply_to = keys.request_stream("synthetic"), f"{key_prefix}:test-replies"
    await redis_client.xadd(reply_to, {"opened": "1"})  # workers reply with NOMKSTREAM
    triggers = [{**meta, "stream": stream} for meta in stream_triggers()]
    samples: list[tuple[int, list[int]]] = []  # (backlog, each trigger's figure)
    queued = 0
    for _step in range(STEPS):
        now = now_ms()
        async with redis_client.pipeline(transaction=False) as pipe:
            for i in range(queued, queued + REQUESTS_PER_STEP):
                message = RequestMessage(request_id=RequestId(f"r{i}"), model="synthetic", inputs=[i],
                                         reply_to=reply_to, deadline_ms=now + 120_000, enqueued_ms=now)
                pipe.xadd(stream, {ENTRY_FIELD: message.encode()})
            await pipe.execute()
        queued += REQUESTS_PER_STEP
        await asyncio.sleep(0.5)
        async with redis_client.pipeline(transaction=True) as pipe:  # one consistent view
            pipe.xrange(reply_to)  # a batch's replies to one stream share an entry: count the replies
            for meta in triggers:
                queue_figure(pipe, meta, stream)
            entries, *figures = await pipe.execute()
        replies = sum(len(ReplyMessage.from_entry(fields)) for _id, fields in entries)
        samples.append((queued - replies, [figure(m, f) for m, f in zip(triggers, figures, strict=True)]))
    for backlog, figures in samples:  # a batch's reply may be out while its entry is not yet deleted
        assert all(backlog <= figure <= backlog + WORKERS * MAX_BATCH_SIZE for figure in figures), samples
    for i, meta in enumerate(triggers):
        assert samples[-1][1][i] > samples[0][1][i] + REQUESTS_PER_STEP, samples
        assert desired_replicas(samples[-1][1][i], meta) > WORKERS, (samples, meta)
