"""Hop 4: `publish_replies` sends every reply of a batch, acks its entries and deletes them
from the request stream, all in one MULTI/EXEC pipeline, shielded from cancellation so a
shutdown never leaves a batch half answered.

Replies go to each request's `reply_to` stream with NOMKSTREAM: a gateway that died took its
stream with it, and no worker may recreate it (it would never expire).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from shared.keys import GROUP
from shared.protocol import ENTRY_FIELD, EntryId, ReplyMessage

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


async def publish_replies(
    redis: aioredis.Redis,
    *,
    request_stream: str,
    dead_letter_stream: str,
    replies: Sequence[Outgoing],
    entry_ids: Sequence[EntryId],
    dead_letters: Sequence[DeadLetter] = (),
    reply_maxlen: int,
) -> None:
    """XADD every reply and dead letter, then XACK + XDEL `entry_ids` (which must include the
    dead letters' ids), atomically. Raises RedisError; nothing is acked then, so the entries
    stay pending and are reclaimed."""

    async def _send() -> None:
        async with redis.pipeline(transaction=True) as pipe:
            for out in replies:
                pipe.xadd(
                    out.reply_to,
                    {ENTRY_FIELD: out.reply.encode()},
                    maxlen=reply_maxlen,
                    approximate=True,
                    nomkstream=True,
                )
            for dead in dead_letters:
                fields = cast(dict[FieldT, EncodableT], dead.fields)
                pipe.xadd(
                    dead_letter_stream,
                    {**fields, b"entry_id": dead.entry_id.encode(), b"reason": dead.reason.encode()},
                    maxlen=DEAD_LETTER_MAXLEN,
                    approximate=True,
                )
            if entry_ids:
                pipe.xack(request_stream, GROUP, *entry_ids)
                pipe.xdel(request_stream, *entry_ids)
            await pipe.execute()

    await asyncio.shield(_send())
