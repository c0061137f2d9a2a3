"""A generating sequence's progress in Redis and its chunks on the gateway's reply stream.

Order (docs/concepts/architecture.md "Generation"): a step's progress hashes are written first, its
chunks second, in two round trips (under Redis Cluster the model's keys and a gateway's reply
stream live on different nodes, so one pipeline would not order them). A worker that dies after
the first writes no chunk the successor cannot rebuild: the successor re-sends the last chunk
the progress names (the gateway forwards only text past what it sent: docs/concepts/streams.md)
and goes on.

The progress write is fenced: it happens only while this worker still owns the request's entry
in the consumer group (claimed by another worker, or acked, it does not), in one script with
the ownership check, so a worker that lost its entry to a reclaim learns it before it sends
another chunk, and stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from vramguard.shared.keys import GROUP, Keys
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


# KEYS: the request stream, then one progress hash per sequence. ARGV: group, consumer, then per
# sequence its entry id, tokens, chunk, before, sent, seed, finish, TTL ms. Writes the progress of
# the sequences whose entry this consumer still owns (XPENDING names it); returns the 1-based
# positions of the others. On the model's hash slot: every key carries the {model} tag.
_WRITE_OWNED = """
local lost = {}
for i = 2, #KEYS do
  local a = 2 + (i - 2) * 8
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[a + 1], ARGV[a + 1], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('HSET', KEYS[i], 'tokens', ARGV[a + 2], 'chunk', ARGV[a + 3], 'before', ARGV[a + 4],
               'sent', ARGV[a + 5], 'seed', ARGV[a + 6], 'finish', ARGV[a + 7])
    redis.call('PEXPIRE', KEYS[i], ARGV[a + 8])
  else
    lost[#lost + 1] = i - 1
  end
end
return lost
"""


async def write_progress(redis: aioredis.Redis, keys: Keys, model: str, seqs: list[Sequence], now_ms: int,
                         worker_id: str) -> list[Sequence]:
    """HSET each sequence's Progress, expiring PROGRESS_SLACK_MS after its deadline, if consumer
    `worker_id` still owns its entry (one script). Returns the sequences whose entry it no
    longer owns (claimed by another worker, or acked): nothing is written for them, and their
    generation must stop. Raises RedisError."""
    if not seqs:
        return []
    args: list[bytes | str | int] = [GROUP, worker_id]
    for seq in seqs:
        p = Progress.of(seq)
        args += [seq.entry_id, pack(p.tokens), p.chunk, p.text_before, p.text_sent, p.seed, p.finish_reason or "",
                 max(1, seq.deadline_ms - now_ms) + PROGRESS_SLACK_MS]
    script = redis.register_script(_WRITE_OWNED)
    lost = await script(keys=[keys.request_stream(model), *(keys.generation_progress(model, s.request_id)
                                                             for s in seqs)], args=args)
    return [seqs[int(i) - 1] for i in cast(list[int], lost or [])]


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
