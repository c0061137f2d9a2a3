"""Hop 4: `publish_replies` sends every reply of a batch, then acks its entries and deletes them
from the request stream (with any dead letters, and lowering the model's queued-requests counter by
the requests they carried) in one MULTI/EXEC, the whole shielded from cancellation so a shutdown
never leaves a batch half answered. A pack (several requests in one entry, worker/entries.py) is
acked with its last request: until then its answered requests only count down in the ledger.

Two steps because under Redis Cluster the reply streams (each gateway's hash slot) and the
request stream (the model's slot) cannot share a MULTI (shared/keys.py). Replies go first: if the
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
from typing import cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from vramguard.shared.keys import GROUP
from vramguard.shared.protocol import ENTRY_FIELD, REPLIES_FIELD, EntryId, ReplyMessage
from vramguard.worker.entries import PART_SEP, PackLedger

DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True, slots=True)
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
    complete, with a DECRBY of `queued_requests` by their requests, atomically. Part ids of packs
    settle in `ledger`, the one that read them, once the replies are out (a reply that never
    left must not count its request answered). Raises RedisError; nothing is acked then, so the
    entries stay pending and are reclaimed (a reply already sent is then sent again, and
    dropped). Raises ValueError for part ids without a ledger (they would never be acked)."""
    if ledger is None and any(PART_SEP in entry_id for entry_id in entry_ids):
        raise ValueError(f"part ids {list(entry_ids)} can only be settled by the ledger that read their pack")
    settle = ledger.settle if ledger is not None else _settle_plain

    async def _send() -> None:
        if replies:
            async with redis.pipeline(transaction=False) as pipe:
                for reply_to, fields in reply_entries(replies).items():
                    pipe.xadd(reply_to, fields, maxlen=reply_maxlen, approximate=True, nomkstream=True)
                await pipe.execute()
        done, requests = settle(entry_ids)
        if not done and not dead_letters:
            return
        async with redis.pipeline(transaction=True) as pipe:  # all on the model's slot
            for dead in dead_letters:
                fields = cast(dict[FieldT, EncodableT], dead.fields)
                pipe.xadd(
                    dead_letter_stream,
                    {**fields, b"entry_id": dead.entry_id.encode(), b"reason": dead.reason.encode()},
                    maxlen=DEAD_LETTER_MAXLEN,
                    approximate=True,
                )
            if done:
                pipe.xack(request_stream, GROUP, *done)
                pipe.xdel(request_stream, *done)
                pipe.decrby(queued_requests, requests)
            await pipe.execute()

    await asyncio.shield(_send())


def _settle_plain(entry_ids: Iterable[EntryId]) -> tuple[list[EntryId], int]:
    """PackLedger.settle for callers that hold no packs (reclaimed suspects, generation): each
    entry one request."""
    ids = list(dict.fromkeys(entry_ids))
    return ids, len(ids)
