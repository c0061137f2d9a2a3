"""Clocks: one shared wall clock for everything compared across hosts, and a monotonic clock for
durations inside one process. Never mix the two.

Hosts' wall clocks disagree (a worker 10 s ahead would drop every request as expired, one 10 s
behind would look dead). So `now_ms()` is this host's wall clock corrected to Redis' clock:
`sync_to_redis` measures the offset with Redis `TIME` (midpoint of the round trip, so the error
is at most half of it) and every process re-syncs periodically (CLOCK_SYNC_INTERVAL_S). Deadlines
(`deadline_ms`, `enqueued_ms`), heartbeat timestamps and `last_ok_ms` are all on this clock, so a
gateway and a worker on different hosts compare like with like. Before the first sync it is the
local clock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis.asyncio as aioredis

CLOCK_SYNC_INTERVAL_S = 5.0

_offset_ms = 0  # Redis' clock minus this host's, in ms; set by sync_to_redis


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


async def sync_to_redis(redis: aioredis.Redis) -> int:
    """Measure this host's offset to Redis' clock with `TIME` and use it from now on; returns the
    offset in ms. Raises RedisError (the previous offset stays)."""
    global _offset_ms
    before = time.time_ns()
    seconds, micros = await redis.time()
    after = time.time_ns()
    redis_ms = int(seconds) * 1000 + int(micros) // 1000
    _offset_ms = redis_ms - (before + after) // 2 // 1_000_000
    return _offset_ms
