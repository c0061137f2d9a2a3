"""Hop 3: `Batcher.read_batch`, XREADGROUP plus the batch window. The one place where a batch
is formed.

Items are what is batched: an entry whose request carries 3 inputs counts 3 toward
`max_batch_size`. A batch is a list of `Slice`s, each a range of one entry's items:

- an entry that fits a batch (at most `max_batch_size` items) is taken whole, oldest first;
- an entry larger than a batch is served in slices: each batch takes the whole entries first,
  then fills what room is left with the next slice of the oldest large entry. So a 1-input
  request read while a 256-input one is in progress rides in the next forward, instead of
  waiting for all of the large request's forwards. While large work is pending, whole entries
  after the first leave half the batch to it, so a steady flow of small requests does not starve
  it. The large entry is answered (and acked) once all its slices are done (worker/batch/serve.py
  reassembles them in item order).

The window is a shrinking deadline on the monotonic clock, `max_wait_ms` from the first entry,
with one loop for every window length (0 included) that polls the stream without blocking
(`poll_pause_ms`: Redis ends a short blocked read on its timer, not on time). It opens only when
the previous batch held more than one item: at low load nothing else is queued and waiting would
only add latency (a request alone would pay the whole window), while under load the previous batch
was full and the window helps fill the next one. While the worker holds work carried over from earlier reads, it still
reads the stream between forwards, without blocking, so that newly arrived requests are seen.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from vramguard.shared.clock import monotonic_ms
from vramguard.shared.keys import GROUP
from vramguard.shared.protocol import EntryId, RequestMessage
from vramguard.worker.batch.entries import Entry, PackLedger, stream_id_of

# A worker holds at most max(max_batch_size, MIN_HELD_ENTRIES) entries read but not finished (a
# pack's requests count one each, worker/batch/entries.py).
# Reading ahead lets a small request overtake large ones already read, but every entry held is
# pending for this worker alone (a large entry is not split across workers), so an unbounded
# read-ahead would hoard the stream from idle workers. One batch can take at most
# max_batch_size entries, so holding more only hoards; the floor keeps read-ahead useful at
# tiny batch sizes (a few large requests in progress and a small one behind them).
MIN_HELD_ENTRIES = 8

# A window polls without blocking, a read every tenth of the window and at least POLL_MS apart.
# Redis ends a blocked read's timeout on its cron, `hz` times a second (10 by default), unless
# something else wakes it first: a BLOCK of a few milliseconds on a quiet stream lasts up to 100
# (measured on Redis 7.0: BLOCK 1, 5, 10 or 20 returned after 99-101 ms; antirez on redis/redis#2774:
# "the actual granularity depends on server.hz"). A 5 ms batch window read with BLOCK lasted 85-100 ms
# whenever nothing more arrived in it.
POLL_MS = 2.0


def poll_pause_ms(left_ms: float, window_ms: float) -> float:
    """How long a window of `window_ms` with `left_ms` to go sleeps after a read that found nothing
    (milliseconds): a tenth of the window, at least POLL_MS, never past the window's end."""
    return min(left_ms, max(POLL_MS, window_ms / 10))


@dataclass(slots=True, eq=False)
class Held:
    """An entry this worker read and has not finished: `taken` of its items are in batches
    already. `closed` is set by whoever answered it early (deadline, failed decode, internal
    error): its remaining items are dropped from later batches."""

    entry: Entry
    taken: int = 0
    closed: bool = False

    @property
    def remaining(self) -> int:
        return self.entry.n_items - self.taken


# Not frozen, though never changed: a frozen dataclass's __init__ costs about three times as much
# (one per request per batch).
@dataclass(slots=True)
class Slice:
    """Items [start, stop) of one held entry, as one part of a batch."""

    held: Held
    start: int
    stop: int

    @classmethod
    def whole(cls, entry: Entry) -> Slice:
        """All of `entry` (a reclaimed entry, served alone)."""
        return cls(Held(entry, entry.n_items), 0, entry.n_items)

    @property
    def entry(self) -> Entry:
        return self.held.entry

    @property
    def entry_id(self) -> EntryId:
        return self.held.entry.entry_id

    @property
    def message(self) -> RequestMessage | None:
        return self.held.entry.message

    @property
    def n_items(self) -> int:
        return self.stop - self.start


class Batcher:
    """Reads batches for one consumer of the `workers` group on one request stream.

    Entries read but not yet (fully) in a batch are held for the next ones (they are already
    pending for this consumer, so they must not be dropped). A worker restarted under the same
    consumer name first replays its own pending entries (XREADGROUP from id 0), so the batch
    it died in is answered without waiting for a reclaim; with `replay_history=False` (the
    Worker's choice) worker/batch/reclaim.py re-delivers them instead, one at a time.
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
        ledger: PackLedger | None = None,
        requests_per_entry: int = 1,
    ) -> None:
        self._redis = redis
        self._stream = stream
        self._consumer = consumer
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self._block_ms = block_ms
        self._clock = clock
        self._held: deque[Held] = deque()
        self._last_batch_items = 0
        # None once our own pending entries are replayed. The Worker turns this off and lets
        # worker/batch/reclaim.py re-deliver them one at a time (a poison among them kills only itself).
        self._history_id: bytes | None = b"0" if replay_history else None
        # Packs read are split into their requests here; whoever acks settles them in this ledger.
        self.ledger = ledger if ledger is not None else PackLedger()
        # Requests per stream entry: in the last read, and at most (ModelConfig.requests_per_entry).
        self._per_entry = 1.0
        self.requests_per_entry = requests_per_entry
        self._entries_read = 0  # stream entries the last read returned

    @property
    def max_held_entries(self) -> int:
        return max(self.max_batch_size, MIN_HELD_ENTRIES)

    @property
    def carried_ids(self) -> list[EntryId]:
        """Entries read (so pending for this consumer) with items not yet in a batch."""
        return [held.entry.entry_id for held in self._held if not held.closed]

    def drain_carry(self) -> list[Slice]:
        """Take the rest of every held entry (at shutdown, so that they are served, not left pending)."""
        rest = [Slice(h, h.taken, h.entry.n_items) for h in self._held if not h.closed]
        for held in self._held:
            held.taken = held.entry.n_items
        self._held.clear()
        return rest

    async def read_batch(self) -> list[Slice]:
        """Up to `max_batch_size` items, as slices of the entries read (see the module docstring),
        or [] after `block_ms` with nothing to read.

        Raises redis.exceptions.RedisError (the caller backs off) and NOGROUP ResponseError when
        the group vanished (the caller recreates it).
        """
        self._held = deque(h for h in self._held if not h.closed and h.remaining > 0)
        if self._held:  # work carried over: look for new arrivals, without waiting for them
            await self._read_more(None)
        else:
            await self._read_more(self._block_ms)
            if not self._held:
                return []
        window_ms = self.max_wait_ms if self._last_batch_items > 1 else 0.0
        deadline = self._clock() + window_ms
        while not self._full() and (left_ms := deadline - self._clock()) > 0:
            before = len(self._held)
            if not await self._read_more(None):
                break  # no room left to read into
            if len(self._held) == before:
                await asyncio.sleep(poll_pause_ms(left_ms, window_ms) / 1000)
        batch = self._form()
        self._last_batch_items = sum(s.n_items for s in batch)
        return batch

    async def _read_more(self, block_ms: int | None) -> bool:
        """Read what room is left (None: do not block); False when there was no room to read.

        An entry carries one request or a pack of several (worker/batch/entries.py), and only a read
        tells which. A read asks for as many entries as the room takes at the last read's requests
        per entry, but never for more than packs of the most requests could fill twice over: a
        read of singles, then one of packs, must not hoard batches of requests from idle workers.
        While a read comes back full and room is left, the stream may hold more: the next read,
        sized by what this one carried, goes at once, without blocking."""
        if self._room() < 1:
            return False
        while True:
            room = self._room()
            count = max(1, min(math.ceil(room / self._per_entry), math.ceil(2 * room / self.requests_per_entry)))
            self._held.extend(Held(entry) for entry in await self._read(count, block_ms))
            if self._entries_read < count or self._room() < 1:
                return True
            block_ms = None

    def _room(self) -> int:
        """Requests that may still be read: within the held bound and a batch's items."""
        return min(self.max_held_entries - len(self._held), self.max_batch_size - self._small_items())

    def _small_items(self) -> int:
        """Items of held entries not yet started that fit a batch whole."""
        return sum(h.entry.n_items for h in self._held if h.taken == 0 and not self._large(h))

    def _large(self, held: Held) -> bool:
        return held.entry.n_items > self.max_batch_size or held.taken > 0

    def _full(self) -> bool:
        return sum(h.remaining for h in self._held) >= self.max_batch_size

    def _form(self) -> list[Slice]:
        """Whole entries first (oldest first, skipping those that no longer fit), then the next
        slices of the large ones (oldest first) in the room left. A suspect (a request whose
        worker died, split from its pack: worker/batch/reclaim.py) is a batch of its own once it is the
        oldest, as the reclaimer serves its suspects, so that if it kills this worker too it takes
        no other request with it."""
        if self._held and self._held[0].entry.delivery_count > 1:
            suspect = self._held.popleft()
            suspect.taken = suspect.entry.n_items
            return [Slice(suspect, 0, suspect.entry.n_items)]
        room = self.max_batch_size
        reserve = self.max_batch_size // 2 if any(self._large(h) for h in self._held) else 0
        batch: list[Slice] = []
        for held in self._held:
            n = held.entry.n_items
            if held.entry.delivery_count > 1:
                continue
            if n == 0 or (not self._large(held) and n <= (room if not batch else room - reserve)):
                batch.append(Slice(held, 0, n))
                held.taken, room = n, room - n
        for held in self._held:
            if room > 0 and self._large(held) and held.remaining > 0 and held.entry.delivery_count == 1:
                n = min(room, held.remaining)
                batch.append(Slice(held, held.taken, held.taken + n))
                held.taken, room = held.taken + n, room - n
        self._held = deque(h for h in self._held if h.remaining > 0)
        return batch

    async def _read(self, count: int, block_ms: int | None) -> list[Entry]:
        if self._history_id is not None:
            history = await self._xreadgroup(self._history_id, count, block_ms=None)
            if history:
                self._history_id = stream_id_of(history[-1].entry_id).encode()
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
        self._entries_read = sum(len(entries) for _s, entries in streams or ())
        read = [(eid, fields) for _s, entries in streams or () for eid, fields in entries if fields]
        out = [entry for eid, fields in read for entry in self.ledger.read_entries(eid, fields)]
        if read:
            self._per_entry = len(out) / len(read)
        return out
