"""`ClockSync`: keeps this process's shared clock (shared/clock.py) synced to Redis' `TIME`,
at start and every CLOCK_SYNC_INTERVAL_S; used by the gateway's lifespan and the worker. A sync
that fails, or finds no sample with a small round trip, keeps the last offset and is retried
after RETRY_S: a stall or an outage is usually short."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from vramguard.shared.clock import CLOCK_SYNC_INTERVAL_S, MAX_SAMPLE_ROUND_TRIP_MS, clock_offset_ms, sync_to_redis

log = logging.getLogger(__name__)

LARGE_OFFSET_MS = 1000  # worth a warning: this host's clock is off (NTP?); vramguard copes, logs may not
RETRY_S = 0.25  # after a failed sync: three TIME round trips, cheap even while Redis is down


class ClockSync:
    """Periodic `sync_to_redis` in its own task (`task`); never stops for an error, which is
    logged, the last offset kept. Like shared/periodic.py it is never cancelled mid-command."""

    def __init__(self, redis: aioredis.Redis, interval_s: float = CLOCK_SYNC_INTERVAL_S) -> None:
        self._redis = redis
        self._interval_s = interval_s
        self._warned = False
        self._stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def sync(self) -> bool:
        """One sync; True when a good sample became the offset. Never raises for an Exception:
        besides RedisError, a reply of an unexpected shape fails in redis-py's parsing."""
        try:
            sample = await sync_to_redis(self._redis)
        except Exception as exc:
            log.warning("clock sync failed; keeping the last offset",
                        extra={"error": repr(exc), "offset_ms": clock_offset_ms()})
            return False
        if not sample.used:
            log.warning("no clock sample with a small round trip (Redis or this host stalled); keeping the last "
                        "offset", extra={"best_round_trip_ms": round(sample.round_trip_ms, 1),
                                         "max_round_trip_ms": MAX_SAMPLE_ROUND_TRIP_MS, "offset_ms": clock_offset_ms()})
            return False
        if abs(sample.offset_ms) > LARGE_OFFSET_MS and not self._warned:
            self._warned = True
            log.warning("this host's clock differs from Redis'; using Redis' clock",
                        extra={"offset_ms": sample.offset_ms})
        return True

    async def start(self) -> None:
        """Sync once now (so the first deadline is on the shared clock), then periodically."""
        synced = await self.sync()
        self.task = asyncio.create_task(self._loop(synced), name="clock-sync")

    async def _loop(self, synced: bool) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._interval_s if synced else RETRY_S)
            if not self._stop.is_set():
                synced = await self.sync()

    async def stop(self) -> None:
        """Let the current sync finish, then stop."""
        self._stop.set()
        if self.task is not None:
            await self.task
