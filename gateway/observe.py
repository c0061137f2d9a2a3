"""HTTP routes for operators (issue 5): `GET /metrics` (Prometheus text), the status page
(`GET /` and `/status`, self-contained HTML that refreshes itself) and `GET /status.json`,
the numbers it shows. Thin: the numbers come from gateway/metrics.py and gateway/health.py."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.health import Health
from gateway.metrics import GatewayMetrics
from gateway.queues import QueueStats
from shared import metrics as m
from shared.clock import now_ms

router = APIRouter()

# Heartbeat fields the status page shows per worker, as numbers (absent ones are omitted).
STATUS_NUMBERS = ("last_batch_size", "mean_batch_size_1m", "items_per_s", "batches", "items", "errors",
                  "probes", "probe_failures", "started_ms", "last_ok_ms", "gpu_utilization_percent",
                  "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes", "mem_budget_bytes",
                  "mem_total_bytes", "oom_events", "batch_splits", "adaptive_cap", "max_batch_size")


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
    """Per model: readiness, queue, workers with state, batch size, throughput and memory."""
    health: Health = request.app.state.health
    queues = await _metrics(request).queue_stats()
    ready, details = health.readiness()
    models = [_model_status(health, name, queues) for name in request.app.state.settings.served_models]
    return {"time_ms": now_ms(), "ready": ready, "reasons": details["reasons"], "redis_ok": queues is not None,
            "models": models}


def _model_status(health: Health, model: str, queues: dict[str, QueueStats] | None) -> dict[str, object]:
    now = now_ms()
    workers: list[dict[str, object]] = []
    per_s = 0.0
    for wid, beat in sorted(health.view.workers.get(model, {}).items()):
        numbers = {k: v for k in STATUS_NUMBERS if (v := m.parse_number(beat.get(k))) is not None}
        per_s += numbers.get("items_per_s", 0.0)
        workers.append({"worker_id": wid, "state": beat.get("state", "unknown"), "device": m.device_label(beat),
                        "problem": health.worker_problem(beat, now), **numbers})
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


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


@cache
def _page() -> str:
    return resources.files("gateway").joinpath("status.html").read_text(encoding="utf-8")
