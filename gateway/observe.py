"""HTTP routes for operators: `GET /metrics` (Prometheus text), the status page
(`GET /` and `/status`, self-contained HTML that refreshes itself) and `GET /status.json`,
the numbers it shows. Thin: the numbers come from gateway/metrics.py and gateway/health.py."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vramguard.gateway.health import Health
from vramguard.gateway.metrics import GatewayMetrics
from vramguard.gateway.queues import QueueStats
from vramguard.gateway.routes import has_api_key
from vramguard.shared.clock import now_ms
from vramguard.shared.heartbeat import WorkerBeat

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
    models = [_model_status(health, name, queues) for name in served]
    beats = [beat for name in served for beat in health.view.workers.get(name, {}).values()]
    return {"time_ms": now_ms(), "ready": ready, "reasons": details["reasons"], "redis_ok": queues is not None,
            "models": models, "gpus": gpu_groups(beats)}


def _model_status(health: Health, model: str, queues: dict[str, QueueStats] | None) -> dict[str, object]:
    now = now_ms()
    workers: list[dict[str, object]] = []
    per_s = 0.0
    for wid, beat in sorted(health.view.workers.get(model, {}).items()):
        fields = {k: v for k, v in beat.as_json().items() if k in STATUS_FIELDS and v is not None}
        per_s += beat.items_per_s
        workers.append({"worker_id": wid, "state": beat.state, "device": beat.device_label,
                        "problem": health.worker_problem(beat, now), **fields})
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
    return resources.files("gateway").joinpath("status.html").read_text(encoding="utf-8")
