"""A generating sequence's progress in Redis and its chunks on the gateway's reply stream.

Order (docs/concepts/architecture.md "Generation"): a step's progress hashes are written first, its
chunks second, in two round trips (under Redis Cluster the model's keys and a gateway's reply
stream live on different nodes, so one pipeline would not order them). A worker that dies after
the first writes no chunk the successor cannot rebuild: the successor re-sends the last chunk
the progress names (the gateway drops a chunk number it already forwarded) and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ReplyMessage, pack, unpack
from vramguard.worker.batch.publish import Outgoing
from vramguard.worker.generate.sequence import Sequence

PROGRESS_SLACK_MS = 60_000  # a progress hash outlives its request's deadline by this much, then expires


@dataclass(frozen=True, slots=True)
class Progress:
    """What a successor needs: the completion's tokens at the last chunk, that chunk's number and
    text span [text_before, text_sent), the sampler's seed, and the finish reason if it ended."""

    tokens: list[int]
    chunk: int
    text_before: int
    text_sent: int
    seed: int
    finish_reason: str | None

    @classmethod
    def of(cls, seq: Sequence) -> Progress:
        return cls(list(seq.generated), seq.chunk, seq.text_before, seq.text_sent, seq.sampling.seed,
                   seq.finish_reason)


def chunk_reply(seq: Sequence, text: str, worker_id: str) -> Outgoing:
    """Chunk number `seq.chunk` carrying `text` (the completion's characters from seq.text_before)."""
    body: dict[str, object] = {
        "chunk": seq.chunk, "offset": seq.text_before, "text": text, "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.generated),
    }
    return Outgoing(seq.reply_to, ReplyMessage(seq.request_id, outputs=[body], worker_id=worker_id,
                                               cost=len(seq.prompt_ids) + len(seq.generated)))


async def write_progress(redis: aioredis.Redis, keys: Keys, model: str, seqs: list[Sequence], now_ms: int) -> None:
    """HSET each sequence's Progress (one pipeline), expiring PROGRESS_SLACK_MS after its deadline."""
    if not seqs:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for seq in seqs:
            key = keys.generation_progress(model, seq.request_id)
            p = Progress.of(seq)
            pipe.hset(key, mapping={"tokens": pack(p.tokens), "chunk": p.chunk, "before": p.text_before,
                                    "sent": p.text_sent, "seed": p.seed, "finish": p.finish_reason or ""})
            pipe.pexpire(key, max(1, seq.deadline_ms - now_ms) + PROGRESS_SLACK_MS)
        await pipe.execute()


async def read_progress(redis: aioredis.Redis, keys: Keys, model: str, request_id: str) -> Progress | None:
    """The progress a dead worker left for `request_id`, or None (a fresh request)."""
    raw = cast(dict[bytes, bytes], await redis.hgetall(keys.generation_progress(model, request_id)))
    if not raw:
        return None
    tokens = unpack(raw[b"tokens"])
    assert isinstance(tokens, list)
    return Progress(tokens=[int(t) for t in tokens], chunk=int(raw[b"chunk"]), text_before=int(raw[b"before"]),
                    text_sent=int(raw[b"sent"]), seed=int(raw[b"seed"]), finish_reason=raw[b"finish"].decode() or None)


async def cancelled(redis: aioredis.Redis, keys: Keys, model: str, seqs: list[Sequence]) -> list[bool]:
    """Per sequence: whether its client is gone, so that the sequence stops. Either its gateway
    asked (the client left), or its gateway's reply stream no longer exists. A missing stream
    means the gateway died, taking its clients' connections with it, and the stream's TTL
    (`reply_stream_ttl_s`, which a live gateway refreshes) ran out; or Redis lost its data, and
    the gateway has failed those streams already. One round trip."""
    if not seqs:
        return []
    streams = sorted({seq.reply_to for seq in seqs})
    async with redis.pipeline(transaction=False) as pipe:
        for seq in seqs:
            pipe.exists(keys.cancel(model, seq.request_id))
        for stream in streams:
            pipe.exists(stream)
        found = await pipe.execute()
    alive = {stream: bool(n) for stream, n in zip(streams, found[len(seqs):], strict=True)}
    return [bool(n) or not alive[seq.reply_to] for seq, n in zip(seqs, found, strict=False)]
