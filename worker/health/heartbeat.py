"""Side path: the worker's heartbeat. Every `heartbeat_interval_ms` the worker writes its
record (shared/heartbeat.py's WorkerBeat: state, counters, placement, memory) to the hash
`keys.heartbeat(worker_id)` with a TTL of `heartbeat_ttl_ms`, and its beat time to the model's
worker index (a sorted set), which gateway/observe/health.py reads. A worker that dies simply stops
beating: its hash expires and the gateway drops it. Beside it, in a task of its own that never
waits on Redis, it touches its alive file, which the liveness probe reads (worker/health/alive.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.clock import now_ms
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import Keys
from vramguard.shared.periodic import Periodic
from vramguard.shared.settings import Settings
from vramguard.worker.health.alive import alive_file, touch_alive_file

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """Counters a worker publishes. `state`: warming -> ready -> draining."""

    state: str = "warming"
    started_ms: int = field(default_factory=now_ms)
    batches: int = 0
    forwards: int = 0
    requests: int = 0
    items: int = 0
    errors: int = 0
    last_batch_size: int = 0
    max_batch_seen: int = 0
    expired: int = 0
    cancelled: int = 0  # requests whose client left before their batch ran: acked, never computed
    queue_delay_ms_sum: float = 0.0  # summed over requests served: mean = queue_delay_ms_sum / requests

    def record_batch(self, items: int, requests: int, forwards: int, errors: int, queue_delay_ms: float = 0.0) -> None:
        self.batches += 1
        self.queue_delay_ms_sum += queue_delay_ms
        self.items += items
        self.requests += requests
        self.forwards += forwards
        self.errors += errors
        self.last_batch_size = items
        self.max_batch_seen = max(self.max_batch_seen, items)


class Heartbeat:
    """Publishes the record `snapshot()` returns (shared/heartbeat.py's WorkerBeat, its
    `beat_ms` set here) every heartbeat interval."""

    def __init__(
        self, settings: Settings, redis: aioredis.Redis, keys: Keys, beat: Callable[[], WorkerBeat]
    ) -> None:
        self._settings = settings
        self._redis = redis
        self._keys = keys
        self._snapshot = beat
        self._beater = Periodic("heartbeat", self._beat_logged, settings.heartbeat_interval_ms / 1000)
        # Its own task: a beat to a stalled Redis waits seconds, and the probe must not read that as a hang.
        self._alive_file = alive_file(settings.key_prefix, settings.consumer_name)
        self._toucher = Periodic("alive-file", self._touch, settings.heartbeat_interval_ms / 1000)

    async def beat(self) -> None:
        """Write one heartbeat. Raises RedisError."""
        record = replace(self._snapshot(), beat_ms=now_ms())
        # Not a MULTI: the hash and the model's index live in different Redis Cluster slots (shared/keys.py).
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(self._keys.heartbeat(record.worker_id), mapping=record.to_hash())  # type: ignore[arg-type]
            pipe.pexpire(self._keys.heartbeat(record.worker_id), self._settings.heartbeat_ttl_ms)
            pipe.zadd(self._keys.worker_index(record.model), {record.worker_id: record.beat_ms})
            await pipe.execute()

    def start(self) -> None:
        self._beater.start()
        self._toucher.start()

    async def _touch(self) -> None:
        try:
            touch_alive_file(self._alive_file)
        except OSError as exc:  # a full or read-only disk: the probe then says hung, which it will see
            log.warning("cannot touch the alive file", extra={"path": str(self._alive_file), "error": str(exc)})

    async def _beat_logged(self) -> None:
        try:
            await self.beat()
        except RedisError as exc:
            log.warning("heartbeat failed", extra={"error": str(exc)})

    async def stop(self) -> None:
        """Stop beating and remove this worker from the index at once (a clean exit)."""
        await self._toucher.stop()
        self._alive_file.unlink(missing_ok=True)
        await self._beater.stop()
        record = self._snapshot()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:  # two slots, as in beat()
                pipe.delete(self._keys.heartbeat(record.worker_id))
                pipe.zrem(self._keys.worker_index(record.model), record.worker_id)
                await pipe.execute()
        except RedisError:
            pass  # the TTL removes it anyway
