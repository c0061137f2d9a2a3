"""Clocks: one shared wall clock for everything compared across hosts, and a monotonic clock for
durations inside one process. Never mix the two.

Hosts' wall clocks disagree (a worker 10 s ahead would drop every request as expired, one 10 s
behind would look dead). So `now_ms()` is this host's wall clock corrected to Redis' clock:
`sync_to_redis` measures the offset with Redis `TIME` (midpoint of the round trip, so the error
is at most half of it; only samples with a small round trip are used, so a stalled Redis cannot
move the clock by seconds) and every process re-syncs periodically (CLOCK_SYNC_INTERVAL_S). Deadlines
(`deadline_ms`, `enqueued_ms`), heartbeat timestamps and `last_ok_ms` are all on this clock, so a
gateway and a worker on different hosts compare like with like. Before the first sync it is the
local clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis.asyncio as aioredis

CLOCK_SYNC_INTERVAL_S = 5.0
CLOCK_SAMPLES = 3  # TIME round trips per sync; the one with the smallest round trip is kept
# A sample's error is at most half its round trip: one whose round trip is longer than this (Redis
# stalled, a loaded host) could be off by seconds and is not used. 100 ms: 50 ms at worst, far
# below what deadlines and heartbeat ages are judged by; Redis on a LAN answers in about 1 ms.
MAX_SAMPLE_ROUND_TRIP_MS = 100.0

_offset_ms = 0  # Redis' clock minus this host's, in ms; set by sync_to_redis


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One TIME: `offset_ms` (Redis' clock minus this host's, taken at the round trip's midpoint)
    and `round_trip_ms` (the sample's error is at most half of it); `used`: whether it was good
    enough to become the offset."""

    offset_ms: int
    round_trip_ms: float
    used: bool = False


def now_ms() -> int:
    """Shared wall-clock time as integer epoch milliseconds (Redis' clock once synced); what
    `deadline_ms`, `enqueued_ms` and heartbeat timestamps use."""
    return time.time_ns() // 1_000_000 + _offset_ms


def monotonic_ms() -> float:
    """Monotonic time in milliseconds (float); only differences are meaningful."""
    return time.monotonic_ns() / 1_000_000


def clock_offset_ms() -> int:
    """Redis' clock minus this host's wall clock, ms, as last measured (0 before any sync)."""
    return _offset_ms


async def sample_clock(redis: aioredis.Redis) -> ClockSample:
    """One `TIME` round trip as a sample (not used yet). Raises what the command raises."""
    before, started = time.time_ns(), time.monotonic_ns()
    seconds, micros = await redis.time()
    after, ended = time.time_ns(), time.monotonic_ns()
    redis_ms = int(seconds) * 1000 + int(micros) // 1000
    return ClockSample(redis_ms - (before + after) // 2 // 1_000_000, (ended - started) / 1_000_000)


async def sync_to_redis(redis: aioredis.Redis, *, samples: int = CLOCK_SAMPLES,
                        max_round_trip_ms: float = MAX_SAMPLE_ROUND_TRIP_MS) -> ClockSample:
    """Measure this host's offset to Redis' clock with `samples` TIME round trips and use the one
    with the smallest round trip, if that is at most `max_round_trip_ms` (NTP's rule: the error of a
    sample is half its round trip). Returns the best sample, `used` saying whether it became the
    offset; when none was good enough the previous offset stays. Raises what TIME raises (the
    previous offset stays)."""
    global _offset_ms
    best = min([await sample_clock(redis) for _ in range(samples)], key=lambda s: s.round_trip_ms)
    if best.round_trip_ms > max_round_trip_ms:
        return best
    _offset_ms = best.offset_ms
    return ClockSample(best.offset_ms, best.round_trip_ms, used=True)
