"""Per-point statistics: latency percentiles (numpy), throughput, errors by outcome, and the
workers' own view of the point (heartbeat counter deltas: mean batch size, queue delay)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from bench.loadgen import PointRun

COUNTER_FIELDS = ("batches", "items", "requests", "queue_delay_ms_sum")


def summarize(run: PointRun, items_per_request: int = 1) -> dict[str, object]:
    """Requests, errors by outcome, req/s and items/s, latency p50/p95/p99/max (ms, all sampled
    requests, failures included) for one PointRun; the percentiles are None when no request was
    sampled (JSON has no NaN). `warmup_errors`: the non-200 outcomes of the warm-up's requests.

    Throughput counts the 200 responses that arrived inside the window, divided by its length.
    """
    outcomes = Counter(s.outcome for s in run.samples)
    rps = run.ok_in_window / run.duration_s
    latencies = np.array([s.latency_ms for s in run.samples], dtype=float)
    p50 = p95 = p99 = max_ms = None
    if latencies.size:
        p50, p95, p99, max_ms = (round(float(v), 2) for v in (*np.percentile(latencies, [50, 95, 99]), latencies.max()))
    return {
        "concurrency": run.concurrency,
        "duration_s": run.duration_s,
        "requests": len(run.samples),
        "ok": outcomes.get("200", 0),
        "errors": {k: v for k, v in sorted(outcomes.items()) if k != "200"},
        "warmup_errors": {k: v for k, v in sorted(run.warmup_outcomes.items()) if k != "200"},
        "rps": round(rps, 2),
        "items_per_s": round(rps * items_per_request, 2),
        "p50_ms": p50,
        "p95_ms": p95,
        "p99_ms": p99,
        "max_ms": max_ms,
    }


def sum_counters(workers: dict[str, dict[str, object]]) -> dict[str, float]:
    """Add up the heartbeat counters of all live workers (GET /v1/models/{model} -> workers).
    A counter a worker does not publish counts as 0."""
    return {name: sum(float(beat.get(name) or 0) for beat in workers.values()) for name in COUNTER_FIELDS}  # type: ignore[arg-type]


def worker_view(before: dict[str, float], after: dict[str, float]) -> dict[str, object]:
    """Mean batch size (items per batch) and mean queue delay (ms, enqueue -> batch start) over
    the point, from the difference of two `sum_counters` snapshots. None where no batch ran."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTER_FIELDS}
    mean_batch = delta["items"] / delta["batches"] if delta["batches"] > 0 else None
    queue_delay = delta["queue_delay_ms_sum"] / delta["requests"] if delta["requests"] > 0 else None
    return {
        "batches": int(delta["batches"]),
        "mean_batch": round(mean_batch, 2) if mean_batch is not None else None,
        "queue_delay_ms": round(queue_delay, 2) if queue_delay is not None else None,
    }


def device_memory_mib(workers: dict[str, dict[str, object]]) -> dict[str, float]:
    """Every numeric `*_bytes` field of the workers' heartbeats (device memory allocated, reserved,
    peak... as the memory-budget code publishes them), summed over workers, in MiB. Empty when
    the workers publish none (then RSS is the only memory figure)."""
    totals: dict[str, float] = {}
    for beat in workers.values():
        for name, value in beat.items():
            if not name.endswith("_bytes") or not isinstance(value, int | float):
                continue
            key = name.removesuffix("_bytes") + "_mib"
            totals[key] = totals.get(key, 0.0) + float(value) / 2**20
    return {k: round(v, 1) for k, v in sorted(totals.items())}
