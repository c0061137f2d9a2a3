"""`GatewayMetrics`: the one Prometheus registry of a gateway and `GET /metrics`.

Gateway-side series (requests by model and outcome, latency, in flight) are recorded around
each inference request by `track`; worker and queue series are built at scrape time by
gateway/observe/cluster_metrics.py. prometheus_client renders the text format. Each app owns its own
registry (not the process-global one), so several apps can live in one test process.

Several gateway processes on one host (`make up`, SO_REUSEPORT) answer /metrics by turns, so
each must render the host's totals, not its own: with `prometheus_multiproc_dir` set, the
gateway series use prometheus_client's multiprocess mode (each process writes mmap files in
that directory; a MultiProcessCollector sums them at scrape time), while the cluster series
are still built once, by the scraping process's ClusterCollector. The launcher empties the
directory before the gateways start (vramguard/cli/up.py). The files of a gateway that exited stay:
its counts remain in the sums, so the totals never go backwards when supervisor restarts one;
only its live gauges are dropped (`mark_process_dead`, as the library documents). `make up`
uses this mode for a single gateway too: one code path, a restart no longer resets its counters,
and the file writes cost about 3 us per request (5 -> 8 us for the three series, measured) against
about 330 us of gateway CPU per request (bench/RESULTS.md, serving-cost suite). Without the setting (a gateway in its
own container) the process keeps its own registry. Multiprocess output has no `_created` samples.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from vramguard.gateway.observe.cluster_metrics import ClusterCollector
from vramguard.gateway.observe.health import Health
from vramguard.gateway.observe.queues import QueueStats, read_queue_stats, read_redis_memory
from vramguard.shared import metrics as m
from vramguard.shared.errors import VramguardError
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ReplyMessage
from vramguard.shared.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """What a route learns about one request while serving it; logged and counted at the end.

    A streamed response outlives its route's `with` block: the route sets `streamed`, the block's
    end then leaves the request in flight and puts the function that ends it in `end`, and the
    stream calls that when its last event is sent or it stops (with the exception that stopped it,
    None when served whole): the request is counted under how its stream ended, timed to that end."""

    model: str
    request_id: str | None = None
    reply: ReplyMessage | None = None
    error_detail: str | None = None  # what the client was not told (VramguardError.detail)
    streamed: bool = False
    end: Callable[[BaseException | None], None] | None = field(default=None, repr=False)


class GatewayMetrics:
    """Owns `registry`: the gateway series (this process's, or with `multiproc_dir` the sum over
    the processes sharing it) plus the ClusterCollector."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys, health: Health) -> None:
        """Raises RuntimeError when `settings.prometheus_multiproc_dir` cannot be used (see
        `multiprocess_dir`)."""
        self._redis = redis
        self._keys = keys
        self._models = list(settings.served_models)
        self.multiproc_dir = multiprocess_dir(settings)
        self.registry = CollectorRegistry()
        # Own registry: the series live in `registry`. Multiprocess: their values live in the shared
        # files and the MultiProcessCollector renders the sum, so they are registered nowhere
        # (registered too, this process's own values would be rendered a second time).
        own: CollectorRegistry | None = self.registry
        if self.multiproc_dir is not None:
            MultiProcessCollector(self.registry, path=str(self.multiproc_dir))  # type: ignore[no-untyped-call]
            own = None
        self.requests = Counter(m.REQUESTS, "Inference requests by model and outcome (error code, ok, or cancelled: "
                                "the client left); a streamed one when its stream ends, under how it ended.",
                                [m.MODEL, m.OUTCOME], registry=own)
        self.duration = Histogram(m.REQUEST_DURATION, "Inference request latency at the gateway (a streamed "
                                  "request's to its last event).",
                                  [m.MODEL, m.OUTCOME], buckets=m.REQUEST_DURATION_BUCKETS_S, registry=own)
        # livesum (multiprocess mode only; ignored otherwise): the requests in flight on the host are the sum
        # over its gateways, and a gateway that exited serves none, so its last value must not count.
        self.in_flight = Gauge(m.REQUESTS_IN_FLIGHT,
                               "Inference requests being served by this gateway (multiprocess: by the host's).",
                               [m.MODEL], registry=own, multiprocess_mode="livesum")
        # The served models' children of the hot outcome, looked up once: `labels()` takes a lock and
        # builds its key each call, a few percent of the gateway's CPU per request when done per request.
        self._in_flight = {model: self.in_flight.labels(model) for model in self._models}
        self._ok = {model: (self.requests.labels(model, "ok"), self.duration.labels(model, "ok"))
                    for model in self._models}
        # Not multiprocess: built from Redis at each scrape by the scraping process, so it appears once.
        bounds = {model: settings.model_config_for(model).queue_bound for model in self._models}
        self.cluster = ClusterCollector(health, self._models, bounds)
        self.registry.register(self.cluster)

    def track(self, model: str) -> RequestTracking:
        """Count, time and log one request to a served `model` over a `with` block, which gives its
        RequestRecord. The outcome is "ok", or the code of the VramguardError that escapes
        (re-raised), "cancelled", or "internal" for anything else."""
        return RequestTracking(self, model)

    def refused(self, model: str, exc: VramguardError, request_id: str, elapsed_s: float) -> None:
        """Count, time and log a request that `exc` refused before `track` began (its body was
        unreadable or invalid before it named a model), under `model` and the error's code."""
        record = RequestRecord(model, request_id=request_id, error_detail=exc.detail)
        self._finish(record, exc.code, elapsed_s)

    def _finish(self, record: RequestRecord, outcome: str, elapsed_s: float) -> None:
        model = record.model
        if outcome == "ok" and model in self._ok:
            requests, duration = self._ok[model]
        else:
            requests, duration = self.requests.labels(model, outcome), self.duration.labels(model, outcome)
        requests.inc()
        duration.observe(elapsed_s)
        _log_request(record, outcome, elapsed_s)

    async def queue_stats(self) -> dict[str, QueueStats] | None:
        return await read_queue_stats(self._redis, self._keys, self._models)

    async def render(self) -> bytes:
        """The Prometheus text exposition of this gateway and all live workers."""
        queues = await self.queue_stats()
        memory = await read_redis_memory(self._redis) if queues is not None else None
        if self.multiproc_dir is not None:
            forget_dead_processes(self.multiproc_dir)
        self.cluster.queues, self.cluster.redis_memory = queues, memory  # no await from here: one scrape's view
        return generate_latest(self.registry)

    def close(self) -> None:
        """At exit: this process's live gauges leave the host's sums (no-op with one process)."""
        if self.multiproc_dir is not None:
            mark_process_dead(os.getpid(), str(self.multiproc_dir))  # type: ignore[no-untyped-call]


def multiprocess_dir(settings: Settings) -> Path | None:
    """`settings.prometheus_multiproc_dir`, created if missing, or None when unset.

    Raises RuntimeError when it is set but prometheus_client is in single-process mode: the
    library chooses its mode from PROMETHEUS_MULTIPROC_DIR once, at import, so a directory given
    only to Settings (in code) would be rendered empty while the counts stayed in memory.
    """
    if settings.prometheus_multiproc_dir is None:
        return None
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError("prometheus_multiproc_dir is set, but prometheus_client was imported without "
                           "PROMETHEUS_MULTIPROC_DIR in the environment; set that variable instead")
    path = Path(settings.prometheus_multiproc_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def forget_dead_processes(path: Path) -> list[int]:
    """`mark_process_dead` for each process with live-gauge files in `path` that no longer runs
    (a gateway killed before its `close`); returns their pids. The library's docs call it from
    the process manager's child-exit hook (gunicorn's); supervisor would need an event-listener
    program for that, so the scraping gateway does it, which also covers gateways started by
    hand. Counter and histogram files stay."""
    dead: set[int] = set()
    for file in path.glob("gauge_live*_*.db"):
        pid = file.stem.rsplit("_", 1)[-1]
        if pid.isdigit() and not _running(int(pid)):
            dead.add(int(pid))
    for dead_pid in sorted(dead):
        mark_process_dead(dead_pid, str(path))  # type: ignore[no-untyped-call]
    return sorted(dead)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's: the gateways sharing a directory run as one user, so the pid was reused
    return True


class RequestTracking:
    """`GatewayMetrics.track`'s block. A class rather than a generator-based context manager:
    every inference request enters one, and contextlib's wrapper costs a generator and its frames."""

    __slots__ = ("_metrics", "_record", "_in_flight", "_started")

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self._metrics = metrics
        self._record = RequestRecord(model)
        self._in_flight = metrics._in_flight.get(model) or metrics.in_flight.labels(model)

    def __enter__(self) -> RequestRecord:
        self._started = time.perf_counter()
        self._in_flight.inc()
        return self._record

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None and self._record.streamed:
            self._record.end = self.end  # the stream ends it (RequestRecord says why)
            return
        self.end(exc)

    def end(self, exc: BaseException | None) -> None:
        """Count, time and log the request as ended by `exc` (None: served)."""
        elapsed_s = time.perf_counter() - self._started
        self._in_flight.dec()
        record = self._record
        record.end = None
        if exc is None:
            outcome = "ok"
        elif isinstance(exc, VramguardError):
            outcome = exc.code
            record.request_id = record.request_id or exc.request_id
            record.error_detail = exc.detail
        elif isinstance(exc, asyncio.CancelledError):
            outcome = "cancelled"  # the client went away
        else:
            outcome = "internal"
        self._metrics._finish(record, outcome, elapsed_s)


def _log_request(record: RequestRecord, outcome: str, elapsed_s: float) -> None:
    # One line per request: errors at INFO, successes at DEBUG (the access log covers them when on).
    # A client that hung up is its own business: DEBUG too, so no client can flood the log.
    quiet = outcome in ("ok", "client_disconnected")
    level = logging.DEBUG if quiet else logging.INFO
    if not log.isEnabledFor(level):
        return  # the line's fields are not built for nobody (a success's, at the default level)
    extra: dict[str, object] = {"model": record.model, "request_id": record.request_id, "outcome": outcome,
                                "duration_ms": round(elapsed_s * 1000, 2)}
    if record.error_detail:
        extra["error_detail"] = record.error_detail
    if record.reply is not None:
        extra.update(worker_id=record.reply.worker_id, batch_size=record.reply.batch_size,
                     queue_delay_ms=record.reply.queue_delay_ms)
    log.log(level, "request done", extra=extra)
