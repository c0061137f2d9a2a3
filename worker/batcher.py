"""Hop 3: `Batcher.read_batch`, XREADGROUP plus the batch window. The one place where a batch
is formed.

Items are what is batched: an entry whose request carries 3 inputs counts 3 toward
`max_batch_size`. The window is a shrinking deadline on the monotonic clock, `max_wait_ms`
from the first entry, with one loop for every window length (0 included). It opens only when
the previous batch held more than one item: at low load nothing else is queued and waiting
would only add latency (the concurrency-1 latency target), while under load the previous batch
was full and the window helps fill the next one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from vramguard.shared.clock import monotonic_ms
from vramguard.shared.keys import GROUP
from vramguard.shared.protocol import ENTRY_FIELD, EntryId, ProtocolError, RequestMessage


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry as read: a decoded request, or the reason it could not be decoded."""

    entry_id: EntryId
    message: RequestMessage | None
    fields: dict[bytes, bytes]
    decode_error: str | None = None

    @property
    def n_items(self) -> int:
        return self.message.n_items if self.message is not None else 0


def decode_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> Entry:
    """Never raises: a malformed entry comes back with `decode_error` set (it goes to the dead letter)."""
    eid = EntryId(entry_id.decode())
    data = fields.get(ENTRY_FIELD)
    if data is None:
        return Entry(eid, None, fields, f"entry has no {ENTRY_FIELD.decode()!r} field")
    try:
        return Entry(eid, RequestMessage.decode(data), fields)
    except ProtocolError as exc:
        return Entry(eid, None, fields, str(exc))


class Batcher:
    """Reads batches for one consumer of the `workers` group on one request stream.

    Entries read beyond a full batch are carried over to the next one (they are already
    pending for this consumer, so they must not be dropped). A worker restarted under the same
    consumer name first replays its own pending entries (XREADGROUP from id 0), so the batch
    it died in is answered without waiting for a reclaim; with `replay_history=False` (the
    Worker's choice) worker/reclaim.py re-delivers them instead, one at a time.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        consumer: str,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        block_ms: int,
        clock: Callable[[], float] = monotonic_ms,
        replay_history: bool = True,
    ) -> None:
        self._redis = redis
        self._stream = stream
        self._consumer = consumer
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self._block_ms = block_ms
        self._clock = clock
        self._carry: deque[Entry] = deque()
        self._last_batch_items = 0
        # None once our own pending entries are replayed. The Worker turns this off and lets
        # worker/reclaim.py re-deliver them one at a time (a poison among them kills only itself).
        self._history_id: bytes | None = b"0" if replay_history else None

    @property
    def carried_ids(self) -> list[EntryId]:
        """Entries read (so pending for this consumer) but kept for the next batch."""
        return [entry.entry_id for entry in self._carry]

    def drain_carry(self) -> list[Entry]:
        """Take the carried-over entries (at shutdown, so that they are served, not left pending)."""
        entries = list(self._carry)
        self._carry.clear()
        return entries

    async def read_batch(self) -> list[Entry]:
        """Up to `max_batch_size` items (at least one entry even if it alone is larger), or [] after
        `block_ms` with nothing to read.

        Raises redis.exceptions.RedisError (the caller backs off) and NOGROUP ResponseError when
        the group vanished (the caller recreates it).
        """
        batch: list[Entry] = []
        items = self._take_carry(batch, 0)
        if self._carry:
            return self._finish(batch, items)  # already full from the carry-over; keep FIFO order
        if not batch:
            batch = await self._read(self.max_batch_size, self._block_ms)
            items = self._trim(batch)
            if not batch:
                return []
        window_ms = self.max_wait_ms if self._last_batch_items > 1 else 0.0
        deadline = self._clock() + window_ms
        while items < self.max_batch_size:
            remaining = int(deadline - self._clock())
            if remaining < 1:
                break
            more = await self._read(self.max_batch_size - items, remaining)
            batch.extend(more)
            items = self._trim(batch)
        return self._finish(batch, items)

    def _finish(self, batch: list[Entry], items: int) -> list[Entry]:
        self._last_batch_items = items
        return batch

    async def _read(self, count: int, block_ms: int) -> list[Entry]:
        if self._history_id is not None:
            history = await self._xreadgroup(self._history_id, count, block_ms=None)
            if history:
                self._history_id = history[-1].entry_id.encode()
                return history
            self._history_id = None
        return await self._xreadgroup(b">", count, block_ms)

    async def _xreadgroup(self, start_id: bytes, count: int, block_ms: int | None) -> list[Entry]:
        response = await self._redis.xreadgroup(
            GROUP, self._consumer, {self._stream: start_id}, count=max(1, count),
            block=None if block_ms is None else max(1, block_ms),
        )
        streams = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes] | None]]]] | None, response)
        # A pending entry deleted meanwhile comes back as (id, None/{}): nothing left to serve.
        return [decode_entry(eid, fields) for _s, entries in streams or () for eid, fields in entries if fields]

    def _take_carry(self, batch: list[Entry], items: int) -> int:
        while self._carry and (not batch or items + self._carry[0].n_items <= self.max_batch_size):
            entry = self._carry.popleft()
            batch.append(entry)
            items += entry.n_items
        return items

    def _trim(self, batch: list[Entry]) -> int:
        """Move entries past `max_batch_size` items to the carry-over; returns the items kept."""
        items = 0
        for i, entry in enumerate(batch):
            if i > 0 and items + entry.n_items > self.max_batch_size:
                self._carry.extend(batch[i:])
                del batch[i:]
                break
            items += entry.n_items
        return items
