"""The heartbeat schema: one typed record per worker, written by worker/health/heartbeat.py as a Redis
hash and parsed by every reader (gateway health, metrics, model info, status page, bench).

Redis hashes hold strings, so `WorkerBeat.to_hash` writes each field as text and
`WorkerBeat.from_hash` parses it back by the field's declared type. A field a worker of another
version does not write (or writes malformed) reads as its default, never as an error: a mixed
fleet during a rolling restart must not break the gateway. No torch or FastAPI imports here.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

HISTOGRAM_FIELD = "histograms"  # JSON of the worker's histogram snapshots (shared/metrics.py)


@dataclass(frozen=True, slots=True)
class WorkerBeat:
    """What one worker says about itself every `heartbeat_interval_ms`. Times are epoch ms
    (`*_ms` of a moment) or durations in ms; sizes in bytes; `memory_share` is a fraction of the
    device's total memory. Optional numbers are None until the part that measures them has run."""

    # --- identity and placement ---
    worker_id: str = ""
    model: str = ""
    pid: int = 0
    host: str = ""
    device: str = ""  # torch device string: "cuda", "cpu", "sim"
    device_kind: str = ""  # cuda | cpu | sim, from the memory accounting
    gpu: str = ""  # CUDA_VISIBLE_DEVICES of the process (a GPU index or UUID); "" when unpinned
    gpu_uuid: str = ""  # the device's UUID as CUDA reports it ("" on cpu; "SIM-<gpu>" on sim)
    memory_share: float | None = None  # this worker's fraction of the device's total memory
    # --- configured batching (Settings, per model) ---
    max_batch_size: int = 0
    max_wait_ms: float = 0.0
    max_inflight_batches: int = 1
    # --- lifecycle ---
    state: str = "unknown"  # warming -> ready -> draining | unhealthy
    started_ms: int = 0
    beat_ms: int = 0
    # --- counters since start ---
    batches: int = 0
    forwards: int = 0
    requests: int = 0
    items: int = 0
    errors: int = 0
    expired: int = 0
    cancelled: int = 0
    last_batch_size: int = 0
    max_batch_seen: int = 0
    queue_delay_ms_sum: float = 0.0  # summed over requests: mean = queue_delay_ms_sum / requests
    # --- watchdog ---
    healthy: bool = False
    unhealthy_reason: str = ""
    last_ok_ms: int = 0
    probe_interval_ms: int = 0
    probes: int = 0
    probe_failures: int = 0
    failed_batches_in_row: int = 0
    # batch tasks that raised; their requests got 500 internal (worker/batch/batch_errors.py)
    batch_task_failures: int = 0
    reclaimed: int = 0  # entries claimed from a dead worker (or this one's previous life), worker/batch/reclaim.py
    dead_lettered: int = 0  # entries this worker moved to the dead-letter stream after max_deliveries
    # --- throughput, last minute ---
    items_per_s: float = 0.0
    mean_batch_size_1m: float = 0.0
    gpu_utilization_percent: float | None = None
    histograms: str = ""
    # --- device memory now (the accounting's own numbers) ---
    mem_total_bytes: int | None = None
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_peak_bytes: int | None = None
    mem_budget_bytes: int | None = None
    mem_cap_bytes: int | None = None  # the allocator's cap: (budget - outside) (set_per_process_memory_fraction)
    mem_outside_bytes: int | None = None  # this process's memory outside the allocator (context, kernel modules)
    mem_max_reserved_bytes: int | None = None  # highest reserved since the plan was made (max_memory_reserved)
    oom_events: int = 0
    batch_splits: int = 0
    adaptive_batch_cap: int | None = None  # items per forward now, after OOMs (<= plan_batch_size)
    largest_forward: int = 0
    max_concurrent_forwards: int = 0  # most forwards that ran at once (max_inflight_batches > 1)
    # --- the memory plan made at start (worker/memory/budget.py) ---
    plan_context_bytes: int | None = None
    plan_weights_bytes: int | None = None
    plan_fixed_bytes: int | None = None
    plan_per_item_bytes: int | None = None
    plan_per_token_bytes: float | None = None
    plan_batch_size: int | None = None  # the largest forward the budget holds, <= max_batch_size
    plan_batch_tokens: int | None = None  # text models: padded tokens per forward
    plan_inflight_batches: int | None = None  # concurrent forwards the budget holds
    # --- text generation (worker/generate/): JSON of the KV plan and the sequence counters; "" otherwise ---
    generation: str = ""

    def to_hash(self) -> dict[str, str]:
        """The Redis hash: every field that has a value, as text (bools as 1/0)."""
        out: dict[str, str] = {}
        # Every field is a scalar: read in place (asdict deep-copies, and a worker beats several
        # times a second; the gateway's /v1/models parses what this writes).
        for name in _NAMES:
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> WorkerBeat:
        """Parse a heartbeat hash (as HGETALL returns it). Unknown fields are ignored; missing or
        malformed ones take their default."""
        text = {_text(k): _text(v) for k, v in raw.items()}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in text:
                parsed = _parse(text[f.name], _HINTS[f.name])
                if parsed is not _INVALID:
                    values[f.name] = parsed
        return cls(**values)

    def as_json(self, *, with_histograms: bool = False) -> dict[str, object]:
        """The record for JSON responses: numbers as numbers, `generation` as the object its JSON
        holds (null for a model that does not generate, or a beat whose JSON is malformed);
        histograms only when asked."""
        data = asdict(self)
        data["generation"] = _json_object(self.generation)
        if not with_histograms:
            data.pop(HISTOGRAM_FIELD)
        return data

    @property
    def device_label(self) -> str:
        """The `device` label of this worker's series: cuda | cpu | sim."""
        return self.device_kind or self.device.split(":", 1)[0] or "unknown"


_INVALID = object()
_HINTS = typing.get_type_hints(WorkerBeat)
_NAMES = tuple(f.name for f in fields(WorkerBeat))


def _json_object(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(value: str, hint: Any) -> object:
    """`value` as the field type `hint` (str, int, float, bool, or one of them | None)."""
    if isinstance(hint, types.UnionType):
        if value == "":
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is str:
        return value
    if hint is bool:
        return value in ("1", "true", "True")
    try:
        number = float(value)
    except ValueError:
        return _INVALID
    if not math.isfinite(number):
        return _INVALID
    return int(number) if hint is int else number


def beat_field_names() -> tuple[str, ...]:
    """Every field of the schema, in declaration order (metric and status-page tables use them)."""
    return tuple(f.name for f in fields(WorkerBeat))
