"""Liveness and readiness from the workers' heartbeats (side path of hop 2).

A background task refreshes, every heartbeat interval, which workers of each served model
have a fresh heartbeat (sorted set `keys.worker_index(model)`, score = epoch ms of the last
beat) and what their heartbeat hash says. Admission (`require_worker`) and `/health/ready`
read this cached view, so no request pays a Redis round trip for it. Admission also accepts
while a model's workers can be expected back (gateway/admission/expected.py), though readiness says no.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, ClusterError

from vramguard.gateway.admission.expected import ReturnWatch
from vramguard.shared.clock import now_ms
from vramguard.shared.errors import UnavailableError
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import Keys
from vramguard.shared.periodic import Periodic
from vramguard.shared.redis_client import describe_refusal, eviction_problem
from vramguard.shared.settings import Settings
from vramguard.shared.tasks import TaskWatch

log = logging.getLogger(__name__)


@dataclass
class HealthView:
    """What the last refresh saw: whether Redis answered, and per model the workers with a fresh
    heartbeat, each as its parsed record (shared/heartbeat.py)."""

    redis_ok: bool = False
    redis_error: str = "not checked yet"
    # Why Redis refused the refresh's write, in words fit for any client (read-only, out of memory).
    redis_refusal: str | None = None
    # Its maxmemory-policy evicts (read every refresh: CONFIG SET changes it at run time).
    eviction: str | None = None
    workers: dict[str, dict[str, WorkerBeat]] = field(default_factory=dict)
    refreshed_ms: int = 0
    start_failures: dict[str, list[str]] = field(default_factory=dict)  # model -> why its workers' starts failed


class Health:
    """Keeps a `HealthView` fresh and answers readiness and admission questions from it."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys, tasks: TaskWatch | None = None) -> None:
        self._settings = settings
        self._redis = redis
        self._keys = keys
        self.view = HealthView(workers={m: {} for m in settings.served_models})
        self.shutting_down = False  # readiness fails (SIGTERM); admission goes on until admission_closed
        self.admission_closed = False  # the drain: new requests get 503
        self.tasks = tasks or TaskWatch()
        self.returns = ReturnWatch(settings.worker_return_grace_s)
        self._refresher = Periodic("health-refresh", self.refresh, settings.heartbeat_interval_ms / 1000)
        # Per model, until when (epoch ms) `view` has a live worker of it: admission asks once per
        # request, and rebuilding live_workers' dict each time was about 3% of the gateway's CPU.
        self._live_view: HealthView | None = None
        self._live_until: dict[str, int] = {}

    async def start(self) -> None:
        await self.refresh()  # admission must not start from an empty view
        self._refresher.start()
        assert self._refresher.task is not None
        self.tasks.watch(self._refresher.task)

    async def stop(self) -> None:
        await self._refresher.stop()

    async def refresh(self) -> None:
        """Re-read the worker index and heartbeats; never raises (a Redis failure is recorded)."""
        now = now_ms()
        oldest = now - self._settings.heartbeat_ttl_ms
        kept_from = now - max(self._settings.heartbeat_ttl_ms, self.returns.grace_ms)  # evidence for ReturnWatch
        try:
            workers: dict[str, dict[str, WorkerBeat]] = {}
            failures: dict[str, list[str]] = {}
            for model in self._settings.served_models:
                index = self._keys.worker_index(model)
                await self._redis.zremrangebyscore(index, "-inf", f"({kept_from}")
                newest = cast(list[tuple[bytes, float]], await self._redis.zrevrange(index, 0, 0, withscores=True))
                self.returns.saw(model, newest[0][1] if newest else None)
                ids = cast(list[bytes], await self._redis.zrangebyscore(index, oldest, "+inf"))
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hgetall(self._keys.start_failures(model))
                    for worker_id in ids:
                        pipe.hgetall(self._keys.heartbeat(worker_id.decode()))
                    failed, *beats = await pipe.execute()
                failures[model] = start_failures(failed, now)
                workers[model] = {
                    wid.decode(): WorkerBeat.from_hash(beat) for wid, beat in zip(ids, beats, strict=True) if beat
                }
            eviction = None if self._settings.redis_eviction_check == "off" else await eviction_problem(self._redis)
            if eviction is not None and eviction != self.view.eviction:
                log.error(eviction)  # once per change
            self.view = HealthView(redis_ok=True, redis_error="", workers=workers, refreshed_ms=now,
                                   start_failures=failures, eviction=eviction)
            for model in self._settings.served_models:
                if self.live_workers(model):
                    self.returns.saw(model, now)
        except Exception as exc:  # any error (a reply of an unexpected shape too): Redis cannot be trusted now
            if isinstance(exc, ClusterError) and not isinstance(exc, ClusterDownError):
                # redis-py ran out of redirects: a slot of the model is migrating between two healthy
                # primaries (coalesce.py's CLUSTER_REDIRECT_RETRY says why it loops). The last view
                # stands until the next refresh, instead of 503 for every request of this interval.
                log.info("Redis Cluster redirects ran out (a slot migrating); keeping the last view",
                         extra={"error": repr(exc)})
                return
            error = str(exc) or type(exc).__name__
            if self.view.redis_ok or self.view.redis_error != error:  # once per change, not once per beat
                log.warning("Redis check failed; not ready", extra={"error": repr(exc)})
            self.view = HealthView(redis_ok=False, redis_error=error, refreshed_ms=now,
                                   redis_refusal=describe_refusal(exc))

    def live_workers(self, model: str) -> dict[str, WorkerBeat]:
        """Workers of `model` whose heartbeat was fresh at the last refresh, who report ready and
        whose last successful probe or batch is recent (`worker_problem` is None)."""
        now = now_ms()
        return {w: b for w, b in self.view.workers.get(model, {}).items() if self.worker_problem(b, now) is None}

    def worker_problem(self, beat: WorkerBeat, now: int) -> str | None:
        """Why a worker with a fresh heartbeat cannot serve, or None when it can.

        It must say state=ready and healthy, and its `last_ok_ms` (epoch ms of its last
        successful probe, warmup or batch) must be younger than twice its own
        `probe_interval_ms` plus heartbeat_ttl_ms: an idle worker probes every interval and a
        busy one succeeds with each batch, so an older mark means a hung or failing device.
        """
        if beat.state != "ready":
            return f"state={beat.state}" + (f" ({beat.unhealthy_reason})" if beat.unhealthy_reason else "")
        if not beat.healthy:
            return "no successful probe reported"
        age_ms = now - beat.last_ok_ms
        if age_ms > 2 * beat.probe_interval_ms + self._settings.heartbeat_ttl_ms:
            return f"last successful probe or batch {age_ms / 1000:.1f} s ago"
        return None

    def require_worker(self, model: str) -> None:
        """Raise UnavailableError unless Redis answered and `model` has a live, ready worker, or
        one was live within worker_return_grace_s (it is restarting: the request waits for it,
        up to its deadline)."""
        if self.admission_closed:
            raise UnavailableError("the gateway is shutting down")
        if not self.view.redis_ok:
            raise UnavailableError(f"{self.view.redis_refusal or 'the broker is unreachable'}; retry later",
                                   detail=self.view.redis_error)
        if self.view.eviction is not None and self._settings.redis_eviction_check == "refuse":
            raise UnavailableError(f"{self.view.eviction} (VRAMGUARD_REDIS_EVICTION_CHECK=refuse)")
        now = now_ms()
        if not self.has_live_worker(model, now) and not self.returns.expected(model, now):
            raise UnavailableError(f"no live worker serves model {model!r}")

    def has_live_worker(self, model: str, now: int) -> bool:
        """Whether `live_workers(model)` is non-empty at `now` (epoch ms), from a per-view cache: a
        worker that `worker_problem` passes stays live until its `last_ok_ms` ages past the limit,
        so the answer holds until the latest such moment among them, or until the view is replaced."""
        view = self.view
        if view is not self._live_view:
            self._live_view, self._live_until = view, {}
        until = self._live_until.get(model)
        if until is None or now > until:
            until = self._live_until[model] = max(
                (b.last_ok_ms + 2 * b.probe_interval_ms + self._settings.heartbeat_ttl_ms
                 for b in view.workers.get(model, {}).values() if self.worker_problem(b, now) is None), default=-1)
        return now <= until

    def readiness(self, *, detail: bool = False) -> tuple[bool, dict[str, object]]:
        """(ready, details): whether this gateway can serve. Ready while it is not shutting down,
        its long-lived tasks run, Redis answers and at least one served model has a live worker:
        a model without one (a plug-in that crash-loops) is listed under `models` with its reasons
        but does not take the gateway, and the healthy models with it, out of its Service; its
        requests get 503 (per-model readiness: model_readiness). `detail`: show Redis' own error
        text (host names) in the reasons: only for callers that presented the API key; the log has it."""
        reasons: list[str] = []
        if self.shutting_down:
            reasons.append("gateway is shutting down")
        if self.tasks.ended is not None:
            reasons.append(self.tasks.ended)
        if not self.view.redis_ok:
            reasons.append(self._redis_reason(detail))
        warnings = [] if self.view.eviction is None else [f"redis: {self.view.eviction}"]
        if self._settings.redis_eviction_check == "refuse":
            reasons.extend(warnings)
            warnings = []
        models: dict[str, object] = {}
        servable = 0
        for model in self._settings.served_models:
            live, beats, missing = self._model_state(model)
            models[model] = {"ready": not missing, "live_workers": live, "heartbeats": beats,
                             "reasons": missing if self.view.redis_ok else []}
            servable += bool(live)
        if self.view.redis_ok and not servable:
            reasons.append("no served model has a live worker")
        return (not reasons, {"ready": not reasons, "reasons": reasons, "warnings": warnings, "models": models})

    def model_readiness(self, model: str, *, detail: bool = False) -> tuple[bool, dict[str, object]]:
        """(ready, details) for one served model (`/v1/models/{model}/ready`, `/v2/models/{model}/ready`):
        the gateway can serve and a worker of `model` has a fresh heartbeat and a recent successful
        probe; else the reasons (Redis' own error text only with `detail`)."""
        _, gateway = self.readiness(detail=detail)
        reasons = [r for r in cast(list[str], gateway["reasons"]) if r != "no served model has a live worker"]
        live, beats, missing = self._model_state(model)
        reasons.extend(missing if self.view.redis_ok else [])
        return not reasons, {"model": model, "ready": not reasons, "live_workers": live, "heartbeats": beats,
                             "reasons": reasons}

    def _redis_reason(self, detail: bool) -> str:
        # Open routes get no host names or Redis text (they may name internal hosts); the log has them.
        # A refusal's own words (read-only, out of memory) name neither.
        if detail:
            return f"redis: {self.view.redis_error}"
        return f"redis: {self.view.redis_refusal or 'unreachable or failing'}"

    def _model_state(self, model: str) -> tuple[int, int, list[str]]:
        """(live workers, fresh heartbeats, what the model lacks: [] when it has a live worker)."""
        beats = self.view.workers.get(model, {})
        now = now_ms()
        problems = {w: p for w, b in beats.items() if (p := self.worker_problem(b, now)) is not None}
        live = len(beats) - len(problems)
        if not beats:  # no fresh heartbeat at all; workers that failed to start say why (worker/health/startfail.py)
            return 0, 0, ["no live worker", *self.view.start_failures.get(model, [])]
        if live == 0:
            return 0, len(beats), [f"no live worker: {w}: {p}" for w, p in sorted(problems.items())]
        return live, len(beats), []


START_FAILURE_MAX_AGE_MS = 600_000  # worker/health/startfail.py's TTL: older records are not the current loop's


def start_failures(raw: dict[bytes, bytes], now: int) -> list[str]:
    """The recent failed starts of a model's workers (worker/health/startfail.py's hash), one reason line
    each: "worker w failed to start: exit 7 (...)"; a malformed record is skipped."""
    lines = []
    for worker_id, value in sorted(raw.items()):
        try:
            record = json.loads(value)
            if now - int(record["at_ms"]) > START_FAILURE_MAX_AGE_MS:
                continue
            lines.append(f"worker {worker_id.decode()} failed to start: exit {int(record['exit_code'])}: "
                         f"{record['reason']}")
        except (ValueError, KeyError, TypeError):
            continue
    return lines
