"""Hop 4: `publish_replies` sends every reply of a batch, then acks its entries and deletes them
from the request stream (with any dead letters, and lowering the model's queued-requests counter by
the requests they carried) in one script (ACK), the whole shielded from cancellation so a shutdown
never leaves a batch half answered. A pack (several requests in one entry, worker/batch/entries.py) is
acked with its last request: until then its answered requests only count down in the ledger.

Two steps because under Redis Cluster the reply streams (each gateway's hash slot) and the
request stream (the model's slot) cannot share a script (shared/keys.py). Replies go first: if the
worker dies between the steps its entries stay pending and are reclaimed, and the gateway drops
the duplicate reply (delivery is at least once, as for any redelivery).

Replies go to each request's `reply_to` stream with NOMKSTREAM: a gateway that died took its
stream with it, and no worker may recreate it (it would never expire). The replies of one call
to the same gateway travel as one entry (shared/protocol.py's REPLIES_FIELD): a batch of 64
answered to one gateway is one XADD, and one entry for that gateway to read and delete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from vramguard.shared.keys import GROUP
from vramguard.shared.protocol import ENTRY_FIELD, REPLIES_FIELD, EntryId, ReplyMessage
from vramguard.worker.batch.entries import PART_SEP, PackLedger

DEAD_LETTER_MAXLEN = 10_000


# Not frozen, though never changed: a frozen dataclass's __init__ costs about three times as much
# (one per request).
@dataclass(slots=True)
class Outgoing:
    """One reply to send: the gateway stream it goes to and the message."""

    reply_to: str
    reply: ReplyMessage


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry moved to the dead-letter stream: its original fields and why it could not be served."""

    entry_id: EntryId
    fields: dict[bytes, bytes]
    reason: str


def reply_entries(replies: Sequence[Outgoing]) -> dict[str, dict[FieldT, EncodableT]]:
    """The fields of one reply-stream entry per gateway (`reply_to`), in first-reply order: a
    lone reply under ENTRY_FIELD, several under REPLIES_FIELD in their order (so a streamed
    reply's chunks stay in order). Raises TypeError for an output that cannot travel."""
    by_stream: dict[str, list[ReplyMessage]] = {}
    for out in replies:
        by_stream.setdefault(out.reply_to, []).append(out.reply)
    return {
        reply_to: {ENTRY_FIELD: group[0].encode()} if len(group) == 1
        else {REPLIES_FIELD: ReplyMessage.encode_many(group)}
        for reply_to, group in by_stream.items()
    }


# The acknowledgement of answered entries, on the model's slot (one script: KEYS request stream,
# dead-letter stream, queued-requests counter). ARGV: group, dead-letter maxlen, the number of dead
# letters, each dead letter's fields (a msgpack array: field, value, ...), then (entry id, requests)
# per entry. XADD the dead letters, XACK the entries, then XDEL each one and lower the counter by
# the requests of those XDEL really deleted: the counter is the one figure here that is not safe to
# change twice, and it would be, by a call redis-py re-sends after a lost reply, or by a worker
# answering a pack that another worker reclaimed and split meanwhile (worker/batch/reclaim.py).
ACK = """
local dead = tonumber(ARGV[3])
for i = 4, 3 + dead do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(cmsgpack.unpack(ARGV[i])))
end
local ids = {}
for i = 4 + dead, #ARGV, 2 do ids[#ids + 1] = ARGV[i] end
if #ids > 0 then redis.call('XACK', KEYS[1], ARGV[1], unpack(ids)) end
local gone = 0
for i = 4 + dead, #ARGV, 2 do
  if redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then gone = gone + tonumber(ARGV[i + 1]) end
end
if gone > 0 then redis.call('DECRBY', KEYS[3], gone) end
return gone
"""


async def publish_replies(
    redis: aioredis.Redis,
    *,
    request_stream: str,
    dead_letter_stream: str,
    queued_requests: str,
    replies: Sequence[Outgoing],
    entry_ids: Sequence[EntryId],
    dead_letters: Sequence[DeadLetter] = (),
    reply_maxlen: int,
    ledger: PackLedger | None = None,
) -> None:
    """XADD the replies (one entry per gateway: `reply_entries`), then XADD the dead letters
    and XACK + XDEL the stream entries `entry_ids` (which must include the dead letters' ids)
    complete, lowering `queued_requests` by the requests of those deleted, atomically (ACK).
    Part ids of packs settle in `ledger`, the one that read them, once the replies are out (a
    reply that never left must not count its request answered). Raises RedisError; nothing is
    acked then, so the entries stay pending and are reclaimed (a reply already sent is then sent
    again, and dropped). Raises ValueError for part ids without a ledger (they would never be acked)."""
    if ledger is None and any(PART_SEP in entry_id for entry_id in entry_ids):
        raise ValueError(f"part ids {list(entry_ids)} can only be settled by the ledger that read their pack")
    settle = ledger.settle if ledger is not None else _settle_plain

    async def _send() -> None:
        if replies:
            async with redis.pipeline(transaction=False) as pipe:
                for reply_to, fields in reply_entries(replies).items():
                    pipe.xadd(reply_to, fields, maxlen=reply_maxlen, approximate=True, nomkstream=True)
                await pipe.execute()
        done = settle(entry_ids)
        if not done and not dead_letters:
            return
        letters = [_dead_letter_fields(dead) for dead in dead_letters]
        args: list[EncodableT] = [GROUP, DEAD_LETTER_MAXLEN, len(letters), *letters]
        for entry_id, requests in done:
            args += [entry_id, requests]
        await redis.register_script(ACK)(keys=[request_stream, dead_letter_stream, queued_requests], args=args)

    await asyncio.shield(_send())


def _dead_letter_fields(dead: DeadLetter) -> bytes:
    """A dead letter's stream fields as ACK takes them: the entry's own fields, its id and the
    reason, flat, as one msgpack array (str types: what Lua's cmsgpack has always read)."""
    fields = {**dead.fields, b"entry_id": dead.entry_id.encode(), b"reason": dead.reason.encode()}
    return msgpack.packb([part for pair in fields.items() for part in pair], use_bin_type=False)  # type: ignore[no-any-return]


def _settle_plain(entry_ids: Iterable[EntryId]) -> list[tuple[EntryId, int]]:
    """PackLedger.settle for callers that hold no packs (reclaimed suspects, generation): each
    entry one request."""
    return [(entry_id, 1) for entry_id in dict.fromkeys(entry_ids)]
