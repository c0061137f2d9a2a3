"""`ClockSync`: keeps this process's shared clock (shared/clock.py) synced to Redis' `TIME`,
at start and every CLOCK_SYNC_INTERVAL_S; used by the gateway's lifespan and the worker."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.clock import CLOCK_SYNC_INTERVAL_S, clock_offset_ms, sync_to_redis
from vramguard.shared.periodic import Periodic

log = logging.getLogger(__name__)

LARGE_OFFSET_MS = 1000  # worth a warning: this host's clock is off (NTP?); vramguard copes, logs may not


class ClockSync:
    """Periodic `sync_to_redis`; Redis errors are logged and the last offset kept."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._warned = False
        self._periodic = Periodic("clock-sync", self.sync, CLOCK_SYNC_INTERVAL_S)

    async def sync(self) -> None:
        """One sync; never raises for Redis errors."""
        try:
            offset = await sync_to_redis(self._redis)
        except RedisError as exc:
            log.warning("clock sync failed; keeping the last offset",
                        extra={"error": str(exc), "offset_ms": clock_offset_ms()})
            return
        if abs(offset) > LARGE_OFFSET_MS and not self._warned:
            self._warned = True
            log.warning("this host's clock differs from Redis'; using Redis' clock", extra={"offset_ms": offset})

    async def start(self) -> None:
        """Sync once now (so the first deadline is on the shared clock), then periodically."""
        await self.sync()
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
