"""The gateway's reading of a generated reply's chunks (gateway/protocols/chat.py): text already
forwarded is dropped (gateway/protocols/chunks.py), a client too far behind is cut, a worker's
error ends the stream, and a cancel (the client left) ends the reading even as a chunk arrives."""

from __future__ import annotations

import asyncio
import time

import pytest

from vramguard.gateway.admission.replies import ReplyStream
from vramguard.gateway.protocols.chat import ClientTooSlowError, _chunks
from vramguard.shared.errors import DeadlineExceededError
from vramguard.shared.protocol import ReplyMessage, RequestId

RID = RequestId("r")


def _chunk(n: int, text: str, finish: str | None = None) -> ReplyMessage:
    """Chunk `n` of a text of one character per chunk: it starts at character n - 1."""
    return ReplyMessage(RID, outputs=[{"chunk": n, "offset": n - 1, "text": text, "finish_reason": finish,
                                       "prompt_tokens": 1, "completion_tokens": n}])


async def _read(stream: ReplyStream, timeout_s: float = 5) -> list[str]:
    return [str(c["text"]) async for c in _chunks(stream, time.monotonic() + timeout_s, RID)]


async def test_a_resumed_workers_resent_chunks_are_dropped() -> None:
    stream = ReplyStream(16)
    for reply in (_chunk(1, "a"), _chunk(2, "b"), _chunk(2, "b"), _chunk(1, "a"), _chunk(3, "c", "length")):
        stream.put(reply)
    assert await _read(stream) == ["a", "b", "c"]


async def test_a_client_more_than_the_bound_behind_is_cut() -> None:
    stream = ReplyStream(2)
    for n in range(1, 4):  # the third does not fit: the client was too slow
        stream.put(_chunk(n, "x"))
    assert stream.overflowed
    with pytest.raises(ClientTooSlowError):
        await _read(stream)


async def test_a_worker_error_or_the_deadline_ends_the_stream() -> None:
    stream = ReplyStream(4)
    stream.put(_chunk(1, "a"))
    stream.put(ReplyMessage.failure(RID, "deadline_exceeded", "deadline passed while generating"))
    with pytest.raises(DeadlineExceededError):
        await _read(stream)
    with pytest.raises(DeadlineExceededError):
        await _read(ReplyStream(4), timeout_s=0.05)  # nothing comes


@pytest.mark.parametrize("passes", range(6))
async def test_a_cancel_as_a_chunk_arrives_ends_the_reading(passes: int) -> None:
    """The disconnect watch cancels the task reading a whole completion. A cancel that lands while
    a chunk is being handed over (each of the first few loop passes after it is queued) must end
    the reading: Python 3.11's asyncio.wait_for returned the chunk instead, the loop went on to
    the next one, and the sequence ran to its end for a client that had left."""
    stream = ReplyStream(16)
    reader = asyncio.create_task(_read(stream))
    await asyncio.sleep(0)  # waiting for its first chunk
    stream.put(_chunk(1, "a"))
    for _ in range(passes):
        await asyncio.sleep(0)
    assert reader.cancel()  # the reader waits for chunk 2 at the latest: not done
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(reader, 2)
