"""What a generative model's worker reads from its stream, and the admission window of an idle worker.

A busy worker reads between steps without blocking: whatever arrived during a step joins the next
one. An idle worker blocks until an entry arrives, and a burst of requests does not arrive at once:
the gateway writes each request to a generative model as an entry of its own, the requests of one
admission call together, and the calls of a burst follow each other by a round trip. On the bench's
stack, 32 streamed completions sent at once landed in 2 or 3 groups of entries within 5 ms; a first
step started on the first group prefilled it alone (16 prompts, 600 ms of SmolLM2 on the CPU) while
the rest waited in the stream for that whole step, so half the burst had its first token a step late.

So an idle worker's read holds an admission window open, `max_wait_ms` from its first entry (the
batch window's setting: worker/batch/batcher.py), and reads what arrives until the window closes or
it has read the room the pool has. As in the batch window, a request alone at low load does not
wait: the window opens only when the first read holds more than one request, or when more than one
sequence ran at once since the worker was last idle. Like the batch window, it polls the stream
without blocking (`poll_pause_ms`: a blocked read's timeout ends on Redis's timer, not on time).
"""

from __future__ import annotations

import asyncio
from typing import cast

import redis.asyncio as aioredis

from vramguard.shared.clock import monotonic_ms
from vramguard.shared.keys import GROUP
from vramguard.worker.batch.batcher import poll_pause_ms
from vramguard.worker.batch.entries import Entry, decode_entry


class Intake:
    """Reads `stream` as `consumer` of the model's group; `window_ms` is the admission window."""

    def __init__(self, stream: str, consumer: str, window_ms: float) -> None:
        self.stream = stream
        self.consumer = consumer
        self.window_ms = window_ms
        self.peak_running = 0  # the most sequences running at once since the worker was last idle

    def note_running(self, running: int) -> None:
        """After a step: `running` sequences held blocks in it."""
        self.peak_running = max(self.peak_running, running)

    async def read(self, redis: aioredis.Redis, room: int, block_ms: int | None) -> list[Entry]:
        """Up to `room` new entries. `block_ms` None: the worker is busy, nothing is waited for; else the
        worker is idle: block up to `block_ms` for a first entry, then hold the admission window (the
        module docstring), reading without blocking. Raises RedisError."""
        if room < 1:
            return []
        entries = await self._read(redis, room, block_ms)
        if block_ms is None or not entries:
            return entries
        if len(entries) > 1 or self.peak_running > 1:
            closes = monotonic_ms() + self.window_ms
            while len(entries) < room and (left := closes - monotonic_ms()) > 0:
                more = await self._read(redis, room - len(entries), None)
                if more:
                    entries += more
                else:
                    await asyncio.sleep(poll_pause_ms(left, self.window_ms) / 1000)
        self.peak_running = 0  # a busy period begins
        return entries

    async def _read(self, redis: aioredis.Redis, count: int, block_ms: int | None) -> list[Entry]:
        response = await redis.xreadgroup(GROUP, self.consumer, {self.stream: b">"}, count=count,
                                          block=None if block_ms is None else max(1, block_ms))
        streams = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes] | None]]]] | None, response)
        return [decode_entry(eid, f) for _s, entries in streams or () for eid, f in entries if f]
