"""An exception inside a batch task (a bug in the worker's own code, not the model's: the model's
failures become `model_error` in execute.py) is never lost: `answer_internal_error` logs it with
the batch's request ids and answers every request of the batch still pending for this worker with
500 `internal` at once, acking it, instead of leaving it to be reclaimed and, after
`max_deliveries`, dead-lettered as if the worker had died. Side path of hop 4; never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.errors import InternalError
from vramguard.shared.keys import GROUP
from vramguard.shared.protocol import ReplyMessage
from vramguard.worker.batch.entries import Entry, PackLedger, stream_id_of, stream_ids
from vramguard.worker.batch.publish import Outgoing, publish_replies

log = logging.getLogger(__name__)


async def answer_internal_error(
    redis: aioredis.Redis, *, stream: str, dead_letter_stream: str, queued_requests: str, worker_id: str,
    entries: Sequence[Entry], exc: BaseException, reply_maxlen: int, ledger: PackLedger,
) -> int:
    """Log `exc` with the request ids of `entries`, then reply 500 internal to those still pending
    for `worker_id` (earlier cost groups of the batch may have been answered already) and ack them
    (a pack's requests through `ledger`, the one that read it, which also knows those of a pack
    still pending that are answered already).
    Returns how many were answered. Never raises: on a Redis error the entries stay pending."""
    request_ids = [e.message.request_id for e in entries if e.message is not None]
    log.error("batch task failed", exc_info=exc,
              extra={"worker_id": worker_id, "request_ids": request_ids, "error": repr(exc)})
    # Stream order, not string order: "1000-10" sorts before "1000-9" as text, and a range from
    # the textual min to the textual max would then be empty or miss entries.
    ids = sorted(stream_ids(e.entry_id for e in entries), key=stream_order)
    try:
        pending = await redis.xpending_range(stream, GROUP, min=ids[0], max=ids[-1], count=len(ids) + 1000,
                                             consumername=worker_id)
        still = {_text(p["message_id"]) for p in pending}
        mine = [e for e in entries if stream_id_of(e.entry_id) in still and ledger.is_open(e.entry_id)
                and e.message is not None]
        message = f"the worker failed while serving this request ({type(exc).__name__}); see its log"
        replies = [Outgoing(e.message.reply_to, ReplyMessage.failure(e.message.request_id, InternalError.code,
                                                                     message, worker_id=worker_id))
                   for e in mine if e.message is not None]
        await publish_replies(redis, request_stream=stream, dead_letter_stream=dead_letter_stream,
                              queued_requests=queued_requests, replies=replies, entry_ids=[e.entry_id for e in mine],
                              reply_maxlen=reply_maxlen, ledger=ledger)
    except RedisError as err:
        log.error("could not answer a failed batch; its entries stay pending", extra={"error": str(err)})
        return 0
    return len(replies)


def stream_order(entry_id: str) -> tuple[int, int]:
    """The sort key of a stream entry id "<ms>-<seq>" as Redis orders them: (ms, seq), both integers.
    Raises ValueError for a string that is not an entry id."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
