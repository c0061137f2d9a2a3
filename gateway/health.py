"""Liveness and readiness from the workers' heartbeats (side path of hop 2).

A background task refreshes, every heartbeat interval, which workers of each served model
have a fresh heartbeat (sorted set `keys.worker_index(model)`, score = epoch ms of the last
beat) and what their heartbeat hash says. Admission (`require_worker`) and `/health/ready`
read this cached view, so no request pays a Redis round trip for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.clock import now_ms
from shared.errors import UnavailableError
from shared.keys import Keys
from shared.periodic import Periodic
from shared.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class HealthView:
    """What the last refresh saw: whether Redis answered, and live workers per model with their
    heartbeat fields (str -> str, as the worker wrote them; see worker/heartbeat.py)."""

    redis_ok: bool = False
    redis_error: str = "not checked yet"
    workers: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    refreshed_ms: int = 0


class Health:
    """Keeps a `HealthView` fresh and answers readiness and admission questions from it."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys) -> None:
        self._settings = settings
        self._redis = redis
        self._keys = keys
        self.view = HealthView(workers={m: {} for m in settings.served_models})
        self.shutting_down = False
        self._refresher = Periodic("health-refresh", self.refresh, settings.heartbeat_interval_ms / 1000)

    async def start(self) -> None:
        await self.refresh()  # admission must not start from an empty view
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()

    async def refresh(self) -> None:
        """Re-read the worker index and heartbeats; never raises (a Redis failure is recorded)."""
        now = now_ms()
        oldest = now - self._settings.heartbeat_ttl_ms
        try:
            workers: dict[str, dict[str, dict[str, str]]] = {}
            for model in self._settings.served_models:
                index = self._keys.worker_index(model)
                await self._redis.zremrangebyscore(index, "-inf", f"({oldest}")
                ids = await self._redis.zrangebyscore(index, oldest, "+inf")
                async with self._redis.pipeline(transaction=False) as pipe:
                    for worker_id in ids:
                        pipe.hgetall(self._keys.heartbeat(worker_id.decode()))
                    beats = await pipe.execute()
                workers[model] = {
                    wid.decode(): {k.decode(): v.decode() for k, v in beat.items()}
                    for wid, beat in zip(ids, beats, strict=True)
                    if beat
                }
            self.view = HealthView(redis_ok=True, redis_error="", workers=workers, refreshed_ms=now)
        except RedisError as exc:
            self.view = HealthView(redis_ok=False, redis_error=str(exc) or type(exc).__name__, refreshed_ms=now)

    def live_workers(self, model: str) -> dict[str, dict[str, str]]:
        """Workers of `model` whose heartbeat was fresh at the last refresh and who report ready."""
        return {w: b for w, b in self.view.workers.get(model, {}).items() if b.get("state") == "ready"}

    def require_worker(self, model: str) -> None:
        """Raise UnavailableError unless Redis answered and `model` has a live, ready worker."""
        if self.shutting_down:
            raise UnavailableError("the gateway is shutting down")
        if not self.view.redis_ok:
            raise UnavailableError(f"Redis is unreachable: {self.view.redis_error}")
        if not self.live_workers(model):
            raise UnavailableError(f"no live worker serves model {model!r}")

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """(ready, details): ready when Redis answers and every served model has a live worker."""
        reasons: list[str] = []
        if self.shutting_down:
            reasons.append("gateway is shutting down")
        if not self.view.redis_ok:
            reasons.append(f"redis: {self.view.redis_error}")
        models = {}
        for model in self._settings.served_models:
            live = len(self.live_workers(model))
            models[model] = {"live_workers": live}
            if self.view.redis_ok and live == 0:
                reasons.append(f"model {model}: no live worker")
        return (not reasons, {"ready": not reasons, "reasons": reasons, "models": models})
