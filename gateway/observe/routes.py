"""HTTP routes for operators: `GET /metrics` (Prometheus text), the status page
(`GET /` and `/status`, self-contained HTML that refreshes itself) and `GET /status.json`,
the numbers it shows. Thin: the numbers come from gateway/observe/metrics.py and gateway/observe/health.py."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.gateway.observe.health import Health
from vramguard.gateway.observe.metrics import GatewayMetrics
from vramguard.gateway.observe.queues import QueueStats
from vramguard.gateway.routes import has_api_key
from vramguard.shared.clock import now_ms
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import Keys

router = APIRouter()

# Heartbeat fields the status page shows per worker (absent ones are omitted).
STATUS_FIELDS = ("last_batch_size", "mean_batch_size_1m", "items_per_s", "batches", "items", "errors",
                 "probes", "probe_failures", "started_ms", "last_ok_ms", "gpu_utilization_percent",
                 "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes", "mem_budget_bytes",
                 "mem_total_bytes", "oom_events", "batch_splits", "adaptive_batch_cap", "max_batch_size",
                 "gpu", "gpu_uuid", "host", "memory_share")
# Summed per GPU for its memory bar: each worker's own numbers, so the bar shows the GPU's use by vramguard.
GPU_SUMS = ("mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes", "mem_budget_bytes", "memory_share")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus scrape target for the gateway and every live worker."""
    body = await _metrics(request).render()
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
@router.get("/status", response_class=HTMLResponse)
async def status_page() -> HTMLResponse:
    """The status page: no build step, no CDN; its script polls /status.json."""
    return HTMLResponse(_page())


@router.get("/status.json")
async def status_json(request: Request) -> dict[str, object]:
    """Per model: readiness, queue, workers with state, batch size, throughput and memory; per
    GPU: its workers (of every model) and their memory summed."""
    health: Health = request.app.state.health
    queues = await _metrics(request).queue_stats()
    ready, details = health.readiness(detail=has_api_key(request))  # an open route: no Redis text without it
    served = request.app.state.settings.served_models
    # Redis just failed the queue read: do not wait for it a second time.
    placed = await placed_workers(request.app.state.redis, request.app.state.keys) if queues is not None else {}
    models = [model_status(health, name, queues, placed) for name in served]
    beats = [beat for name in served for beat in health.view.workers.get(name, {}).values()]
    return {"time_ms": now_ms(), "ready": ready, "reasons": details["reasons"], "redis_ok": queues is not None,
            "models": models, "gpus": gpu_groups(beats)}


async def placed_workers(redis: aioredis.Redis, keys: Keys) -> dict[str, dict[str, object]]:
    """The placement record a `vramguard up` stack keeps (vramguard/cli/placed.py): worker_id -> its
    model, device and last exit. Empty without one (compose, Kubernetes), or when Redis fails."""
    try:
        raw = cast(dict[bytes, bytes], await redis.hgetall(keys.placement()))
    except RedisError:
        return {}
    out: dict[str, dict[str, object]] = {}
    for wid, entry in raw.items():
        try:
            value = json.loads(entry)
        except ValueError:
            continue
        if isinstance(value, dict):
            out[wid.decode(errors="replace")] = value
    return out


def _exit_text(entry: dict[str, object] | None) -> str | None:
    """'exit status 3: <its last logged error>' from a placement record entry; None without an exit."""
    if not entry or not entry.get("exit"):
        return None
    return f"{entry['exit']}: {entry.get('reason') or 'no error logged'}"


def model_status(health: Health, model: str, queues: dict[str, QueueStats] | None,
                  placed: dict[str, dict[str, object]]) -> dict[str, object]:
    """One model's card; its workers are those with a heartbeat and the placed ones without (not
    running: their last exit and its reason as the problem)."""
    now = now_ms()
    workers: list[dict[str, object]] = []
    per_s = 0.0
    beats = health.view.workers.get(model, {})
    for wid, beat in sorted(beats.items()):
        fields = {k: v for k, v in beat.as_json().items() if k in STATUS_FIELDS and v is not None}
        per_s += beat.items_per_s
        workers.append({"worker_id": wid, "state": beat.state, "device": beat.device_label,
                        "problem": health.worker_problem(beat, now), "last_exit": _exit_text(placed.get(wid)),
                        **fields})
    for wid, entry in sorted(placed.items()):
        if entry.get("model") == model and wid not in beats:
            workers.append({"worker_id": wid, "state": "not running", "device": entry.get("device"),
                            "problem": _exit_text(entry) or "no heartbeat yet", "last_exit": _exit_text(entry)})
    stats = queues.get(model) if queues is not None else None
    return {
        "name": model,
        "live_workers": len(health.live_workers(model)),
        "queue_depth": stats.waiting if stats else None,
        "pending_entries": stats.pending if stats else None,
        "dead_letters": stats.dead_letters if stats else None,
        "items_per_s": round(per_s, 3),
        "workers": workers,
    }


def gpu_groups(beats: list[WorkerBeat]) -> list[dict[str, object]]:
    """The workers grouped by the device they run on (host and GPU UUID, else host and
    CUDA_VISIBLE_DEVICES, else host and device kind), with GPU_SUMS summed over each group and
    the device's total memory; sorted by host and GPU."""
    groups: dict[tuple[str, str], dict[str, object]] = {}
    for beat in beats:
        key = (beat.host, beat.gpu_uuid or beat.gpu or beat.device_label)
        group = groups.setdefault(key, {"host": beat.host, "gpu": beat.gpu, "gpu_uuid": beat.gpu_uuid,
                                        "device": beat.device_label, "mem_total_bytes": beat.mem_total_bytes,
                                        "workers": [], **{k: 0 for k in GPU_SUMS}})
        for name in GPU_SUMS:
            group[name] = group[name] + (getattr(beat, name) or 0)  # type: ignore[operator]
        group["workers"].append({"worker_id": beat.worker_id, "model": beat.model,  # type: ignore[attr-defined]
                                 "memory_share": beat.memory_share, "mem_allocated_bytes": beat.mem_allocated_bytes,
                                 "mem_budget_bytes": beat.mem_budget_bytes})
    return [groups[k] for k in sorted(groups)]


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


@cache
def _page() -> str:
    return resources.files("vramguard.gateway.observe").joinpath("status.html").read_text(encoding="utf-8")
