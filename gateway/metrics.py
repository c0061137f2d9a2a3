"""`GatewayMetrics`: the one Prometheus registry of a gateway and `GET /metrics`.

Gateway-side series (requests by model and outcome, latency, in flight) are recorded around
each inference request by `track`; worker and queue series are built at scrape time by
gateway/cluster_metrics.py. prometheus_client renders the text format. Each app owns its own
registry (not the process-global one), so several apps can live in one test process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vramguard.gateway.cluster_metrics import ClusterCollector
from vramguard.gateway.health import Health
from vramguard.gateway.queues import QueueStats, read_queue_stats
from vramguard.shared import metrics as m
from vramguard.shared.errors import VramguardError
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ReplyMessage
from vramguard.shared.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """What a route learns about one request while serving it; logged and counted at the end."""

    model: str
    request_id: str | None = None
    reply: ReplyMessage | None = None
    error_detail: str | None = None  # what the client was not told (VramguardError.detail)


class GatewayMetrics:
    """Owns `registry`: gateway counters plus the ClusterCollector."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys, health: Health) -> None:
        self._redis = redis
        self._keys = keys
        self._models = list(settings.served_models)
        self.registry = CollectorRegistry()
        self.requests = Counter(m.REQUESTS, "Inference requests by model and outcome (error code or ok).",
                                [m.MODEL, m.OUTCOME], registry=self.registry)
        self.duration = Histogram(m.REQUEST_DURATION, "Inference request latency at the gateway.",
                                  [m.MODEL, m.OUTCOME], buckets=m.REQUEST_DURATION_BUCKETS_S, registry=self.registry)
        self.in_flight = Gauge(m.REQUESTS_IN_FLIGHT, "Inference requests being served by this gateway.",
                               [m.MODEL], registry=self.registry)
        for model in self._models:
            self.requests.labels(model, "ok")
            self.in_flight.labels(model)
        self.cluster = ClusterCollector(health, self._models)
        self.registry.register(self.cluster)

    @contextmanager
    def track(self, model: str) -> Iterator[RequestRecord]:
        """Count, time and log one request to a served `model`. The outcome is "ok", or the
        code of the VramguardError that escapes (re-raised), "cancelled", or "internal" for anything else."""
        record = RequestRecord(model)
        outcome = "internal"
        started = time.perf_counter()
        self.in_flight.labels(model).inc()
        try:
            yield record
            outcome = "ok"
        except VramguardError as exc:
            outcome = exc.code
            record.request_id = record.request_id or exc.request_id
            record.error_detail = exc.detail
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client went away
            raise
        finally:
            elapsed_s = time.perf_counter() - started
            self.in_flight.labels(model).dec()
            self.requests.labels(model, outcome).inc()
            self.duration.labels(model, outcome).observe(elapsed_s)
            _log_request(record, outcome, elapsed_s)

    async def queue_stats(self) -> dict[str, QueueStats] | None:
        return await read_queue_stats(self._redis, self._keys, self._models)

    async def render(self) -> bytes:
        """The Prometheus text exposition of this gateway and all live workers."""
        queues = await self.queue_stats()
        self.cluster.queues = queues  # no await between this and rendering: one scrape's view
        return generate_latest(self.registry)


def _log_request(record: RequestRecord, outcome: str, elapsed_s: float) -> None:
    extra: dict[str, object] = {"model": record.model, "request_id": record.request_id, "outcome": outcome,
                                "duration_ms": round(elapsed_s * 1000, 2)}
    if record.error_detail:
        extra["error_detail"] = record.error_detail
    if record.reply is not None:
        extra.update(worker_id=record.reply.worker_id, batch_size=record.reply.batch_size,
                     queue_delay_ms=record.reply.queue_delay_ms)
    # One line per request: errors at INFO, successes at DEBUG (the access log covers them when on).
    # A client that hung up is its own business: DEBUG too, so no client can flood the log.
    quiet = outcome in ("ok", "client_disconnected")
    log.log(logging.DEBUG if quiet else logging.INFO, "request done", extra=extra)
