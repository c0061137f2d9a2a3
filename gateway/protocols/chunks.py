"""A generated stream's text, joined from its worker's chunks so that it cannot splice: each chunk
carries `offset`, where its text starts in the completion (characters), and the gateway forwards
only text that continues what it already sent (docs/concepts/streams.md).

- A chunk that starts at or before the end of the sent text forwards its part past that end:
  nothing already sent is sent twice (a worker's re-send after a failed publish, a successor's
  re-send of the last chunk after a crash, or a stalled worker's late chunk, all carry text the
  client may already have).
- A chunk that starts past the end (a gap: text lost on the way) waits until the text before it
  arrives (a re-send), however long that takes up to the request's deadline; it is never
  forwarded over the gap.

Chunk numbers are not used to decide: two workers generating one request (one stalled past
claim_idle_ms while another resumed it) cut their chunks at different places, so one number may
name different text. Every chunk a worker sends passed a progress write fenced on its ownership
of the request (worker/generate/progress.py), so all chunks of one request agree on the text
they share. Pure logic: no Redis, no asyncio. Never imports torch.
"""

from __future__ import annotations

import logging

from vramguard.shared.errors import UnavailableError

log = logging.getLogger(__name__)

Chunk = dict[str, object]  # {"chunk", "offset", "text", "finish_reason", "prompt_tokens", "completion_tokens"}


class StreamGapError(UnavailableError):
    """More chunks waited behind a gap than the stream holds: the missing text never came."""


class TextJoin:
    """The chunks of one request, joined: `add` returns what to forward, each character once."""

    def __init__(self, request_id: str, bound: int) -> None:
        self.request_id = request_id
        self.sent = 0  # characters of the completion forwarded so far
        self.finished = False
        self._bound = bound
        self._ahead: dict[int, Chunk] = {}  # chunks past a gap, by offset (the longest of each)

    def add(self, chunk: Chunk) -> list[Chunk]:
        """The chunks to forward now, in order, each cut to the text that continues what was sent
        (`text` cut, `offset` the old end): `chunk` itself, then any waiting chunks it unblocked.
        Empty when `chunk` adds nothing or waits behind a gap. Raises StreamGapError when more
        than `bound` chunks wait."""
        out: list[Chunk] = []
        pending = [chunk]
        while pending and not self.finished:
            forwarded = self._take(pending.pop())
            if forwarded is None:
                continue
            out.append(forwarded)
            ready = sorted((o for o in self._ahead if o <= self.sent), reverse=True)
            pending += [self._ahead.pop(o) for o in ready]  # popped smallest offset first
        return out

    def _take(self, chunk: Chunk) -> Chunk | None:
        offset, text = int(chunk["offset"]), str(chunk["text"])  # type: ignore[call-overload]
        finish = chunk.get("finish_reason")
        if offset > self.sent:
            self._wait(offset, chunk)
            return None
        end = offset + len(text)
        if end <= self.sent and finish is None:
            return None  # nothing new: a re-send of text already forwarded
        new = text[self.sent - offset :] if end > self.sent else ""
        forwarded = {**chunk, "offset": self.sent, "text": new}
        self.sent += len(new)
        self.finished = finish is not None
        return forwarded

    def _wait(self, offset: int, chunk: Chunk) -> None:
        if not self._ahead:
            log.warning("gap in a generated stream; waiting for the missing text",
                        extra={"request_id": self.request_id, "sent": self.sent, "offset": offset})
        held = self._ahead.get(offset)
        if held is None or len(str(chunk["text"])) >= len(str(held["text"])):
            self._ahead[offset] = chunk
        if len(self._ahead) > self._bound:
            raise StreamGapError(f"the generated stream lost text after character {self.sent} and it was not "
                                 "sent again; retry the request")
