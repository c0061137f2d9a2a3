"""Metric names, labels, buckets and units, and the one place where the heartbeat's
units (ms, percent) become Prometheus base units (seconds, ratios; bytes stay bytes).

Workers report through their heartbeat hash (worker/health/heartbeat.py); the gateway turns each live
worker's hash into series at scrape time (gateway/observe/cluster_metrics.py), so a dead worker's series
disappear with its hash. Worker-side histograms travel as one JSON field, `histograms`, holding
a `HistogramSnapshot` per histogram. No torch or FastAPI imports here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

from vramguard.shared.heartbeat import WorkerBeat, beat_field_names

PREFIX = "vramguard_"

# Labels. Worker series carry the four of WORKER_LABELS (`gpu`: the worker's CUDA_VISIBLE_DEVICES,
# "" when unpinned); gateway series carry `model` (and `outcome`).
MODEL, WORKER, DEVICE, GPU, OUTCOME = "model", "worker", "device", "gpu", "outcome"
WORKER_LABELS = (MODEL, WORKER, DEVICE, GPU)

# --- gateway-side series ---
REQUESTS = PREFIX + "requests"  # counter; rendered as vramguard_requests_total
REQUEST_DURATION = PREFIX + "request_duration_seconds"
REQUESTS_IN_FLIGHT = PREFIX + "requests_in_flight"
QUEUE_DEPTH = PREFIX + "queue_depth"  # entries waiting for a worker (not yet delivered)
PENDING_ENTRIES = PREFIX + "pending_entries"  # delivered to a worker, not acked
QUEUED_REQUESTS = PREFIX + "queued_requests"  # requests queued + in flight, what queue_bound bounds
DEAD_LETTER_ENTRIES = PREFIX + "dead_letter_entries"
LIVE_WORKERS = PREFIX + "live_workers"
REDIS_UP = PREFIX + "redis_up"
QUEUE_BOUND = PREFIX + "queue_bound"  # requests queued + in flight at which admission answers 429
# Redis' own memory settings and use (INFO memory), read at scrape time: an operator alerts on a
# policy that may evict queued requests (anything but noeviction) and on memory near maxmemory.
REDIS_MAXMEMORY_POLICY = PREFIX + "redis_maxmemory_policy"  # 1, the policy as a label
REDIS_MEMORY_USED = PREFIX + "redis_memory_used_bytes"
REDIS_MAXMEMORY = PREFIX + "redis_maxmemory_bytes"  # 0: no limit
WORKER_INFO = PREFIX + "worker_info"
WORKER_HEALTHY = PREFIX + "worker_healthy"

# --- worker-side histograms (kept in the worker, carried in its heartbeat) ---
BATCH_SIZE = PREFIX + "batch_size"  # items per batch
QUEUE_DELAY = PREFIX + "queue_delay_seconds"  # enqueue to batch start, per request
FORWARD_DURATION = PREFIX + "forward_duration_seconds"  # run_batch of one batch
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"  # a sequence's admission to its first chunk
TIME_PER_OUTPUT_TOKEN = PREFIX + "time_per_output_token_seconds"  # a finished sequence's mean after its first

REQUEST_DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_DELAY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FORWARD_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A first token waits for a prefill behind running steps (tens of ms on a GPU, seconds on a busy
# CPU); a later token is one decode step (ms on a GPU, 50-200 ms for smollm2 on one CPU thread).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)

HISTOGRAMS = {  # short name in the heartbeat -> (metric name, help)
    "batch_size": (BATCH_SIZE, "Items per batch formed by the worker."),
    "queue_delay_seconds": (QUEUE_DELAY, "Time from enqueue to batch start, per request."),
    "forward_duration_seconds": (FORWARD_DURATION, "Duration of one batch's forward passes (run_batch)."),
    "time_to_first_token_seconds": (TIME_TO_FIRST_TOKEN, "Time from a sequence's admission to its first token."),
    "time_per_output_token_seconds": (TIME_PER_OUTPUT_TOKEN,
                                      "Mean time per output token after the first, per finished sequence."),
}


def ms_to_s(value_ms: float) -> float:
    """Milliseconds (the code's unit) to seconds (Prometheus' unit)."""
    return value_ms / 1000.0


@dataclass(frozen=True, slots=True)
class FieldMetric:
    """One numeric heartbeat field exported as one series per worker.

    `scale` turns the field's unit into the metric's base unit (ms -> s is 1e-3).
    Counter names omit `_total`; prometheus_client appends it.
    """

    field: str
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    scale: float = 1.0


WORKER_FIELDS: tuple[FieldMetric, ...] = (
    # A generative model's worker counts in its own terms (docs/reference/metrics.md): a batch is a step,
    # an item a token generated, a request a finished sequence.
    FieldMetric("batches", PREFIX + "worker_batches", "counter", "Batches served (generation: steps)."),
    FieldMetric("forwards", PREFIX + "worker_forwards", "counter",
                "Forward passes run (a batch may split; generation: steps, out-of-memory ones too)."),
    FieldMetric("requests", PREFIX + "worker_requests", "counter", "Requests served (generation: sequences finished)."),
    FieldMetric("items", PREFIX + "worker_items", "counter", "Items (inputs) served (generation: tokens generated)."),
    FieldMetric("errors", PREFIX + "worker_errors", "counter", "Requests answered with an error."),
    FieldMetric("expired", PREFIX + "worker_expired", "counter",
                "Requests whose deadline passed while queued (generation: before their first token)."),
    FieldMetric("cancelled", PREFIX + "worker_cancelled", "counter",
                "Requests whose client left before their batch ran (acked, not computed; generation: before "
                "they finished, stopped at the next step)."),
    FieldMetric("last_batch_size", PREFIX + "worker_last_batch_size", "gauge", "Items in the last batch."),
    FieldMetric("items_per_s", PREFIX + "worker_items_per_second", "gauge", "Items served per second, last minute."),
    FieldMetric("mean_batch_size_1m", PREFIX + "worker_mean_batch_size", "gauge", "Mean items per batch, last minute."),
    FieldMetric("started_ms", PREFIX + "worker_start_time_seconds", "gauge",
                "Process start, epoch seconds (changes on every restart).", 1e-3),
    FieldMetric("last_ok_ms", PREFIX + "worker_last_ok_time_seconds", "gauge",
                "Last successful probe or batch, epoch seconds.", 1e-3),
    FieldMetric("probes", PREFIX + "worker_probes", "counter", "Idle probe forwards run by the watchdog."),
    FieldMetric("probe_failures", PREFIX + "worker_probe_failures", "counter", "Idle probes that failed."),
    FieldMetric("batch_task_failures", PREFIX + "worker_batch_task_failures", "counter",
                "Batch tasks that raised unexpectedly; their requests got 500 internal."),
    FieldMetric("reclaimed", PREFIX + "worker_reclaimed", "counter",
                "Entries claimed from a worker that died (or from this worker's previous life)."),
    FieldMetric("dead_lettered", PREFIX + "worker_dead_lettered", "counter",
                "Entries moved to the dead-letter stream after max_deliveries."),
    FieldMetric("gpu_utilization_percent", PREFIX + "worker_gpu_utilization_ratio", "gauge",
                "GPU busy fraction from NVML (CUDA workers only).", 0.01),
    # Memory fields, published by the memory budget where present.
    FieldMetric("mem_total_bytes", PREFIX + "worker_memory_total_bytes", "gauge", "Device memory in total."),
    FieldMetric("mem_allocated_bytes", PREFIX + "worker_memory_allocated_bytes", "gauge", "Memory allocated now."),
    FieldMetric("mem_reserved_bytes", PREFIX + "worker_memory_reserved_bytes", "gauge", "Memory the allocator holds."),
    FieldMetric("mem_peak_bytes", PREFIX + "worker_memory_peak_bytes", "gauge", "Peak allocated memory."),
    FieldMetric("mem_budget_bytes", PREFIX + "worker_memory_budget_bytes", "gauge", "This worker's memory budget."),
    FieldMetric("oom_events", PREFIX + "worker_oom_events", "counter", "Out-of-memory errors caught."),
    FieldMetric("batch_splits", PREFIX + "worker_batch_splits", "counter", "Batches split to fit the budget."),
    FieldMetric("adaptive_batch_cap", PREFIX + "worker_adaptive_batch_cap", "gauge",
                "Items per forward now, after OOMs (at most the planned batch size)."),
    FieldMetric("memory_share", PREFIX + "worker_memory_share_ratio", "gauge",
                "This worker's fraction of its device's total memory."),
)

def plan_field_metrics() -> tuple[FieldMetric, ...]:
    """One gauge per memory-plan field of the heartbeat schema (`plan_*`): `plan_x_bytes` becomes
    `vramguard_worker_plan_x_bytes`."""
    return tuple(FieldMetric(name, f"{PREFIX}worker_{name}", "gauge", "Memory plan value (measured at start).")
                 for name in beat_field_names() if name.startswith("plan_"))


def worker_label_values(beat: WorkerBeat) -> list[str]:
    """The WORKER_LABELS values of one worker's series."""
    return [beat.model, beat.worker_id, beat.device_label, beat.gpu]


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A histogram as it travels in a heartbeat: cumulative counts per upper bound (the last
    bound is +Inf, whose count is the total) and the sum of observed values, in base units."""

    buckets: tuple[tuple[float, float], ...]
    sum: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"buckets": [[_bound(le), n] for le, n in self.buckets], "sum": self.sum}

    @classmethod
    def from_dict(cls, data: object) -> HistogramSnapshot:
        """Raises ValueError for anything but a well-formed snapshot ending in +Inf."""
        if not isinstance(data, dict) or not isinstance(data.get("buckets"), list):
            raise ValueError("histogram snapshot needs a bucket list")
        buckets = tuple((float(le), float(n)) for le, n in data["buckets"])
        if not buckets or buckets[-1][0] != math.inf:
            raise ValueError("histogram snapshot must end with the +Inf bucket")
        if any(b[1] < a[1] for a, b in zip(buckets, buckets[1:], strict=False)):
            raise ValueError("histogram snapshot counts must be cumulative")
        return cls(buckets=buckets, sum=float(data.get("sum", 0.0)))


def _bound(le: float) -> float | str:
    return "+Inf" if le == math.inf else le


def encode_histograms(snapshots: dict[str, HistogramSnapshot]) -> str:
    """The `histograms` heartbeat field: compact JSON keyed by the short names of HISTOGRAMS."""
    return json.dumps({name: snap.to_dict() for name, snap in snapshots.items()}, separators=(",", ":"))


def decode_histograms(field: str | None) -> dict[str, HistogramSnapshot]:
    """Parse the `histograms` field, keeping only known, well-formed snapshots (a worker of
    another version must not break the scrape)."""
    if not field:
        return {}
    try:
        raw = json.loads(field)
    except ValueError:
        return {}
    out = {}
    for name, data in raw.items() if isinstance(raw, dict) else ():
        if name in HISTOGRAMS:
            try:
                out[name] = HistogramSnapshot.from_dict(data)
            except (ValueError, TypeError):
                continue
    return out
