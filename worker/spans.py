"""A worker's part of a request's trace (shared/tracing.py), under the gateway's request span that
the msgpack request carried:

- `vramguard.queued`: from the XADD (the request's `enqueued_ms`) to the start of the batch that
  first took it, with the entry id and its delivery count (2 and more: a reclaimed request, its
  earlier worker died). Emitted when the batch starts, so a delivery whose worker dies mid-forward
  is in the trace too.
- `vramguard.batch`: the cost group the request ran in, one span per request (a span has one
  parent), with the batch's size in items, its requests, its cost and the memory plan it ran
  under; its children `vramguard.forward` (the forward, OOM splits included) and
  `vramguard.publish` (replies plus XACK in one pipeline).

Spans are built after the fact with the times measured on the way (epoch ns of this host), so the
batch path itself only reads the clock; every function returns at once when tracing is off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vramguard.shared.tracing import ATTR_MODEL, ATTR_REQUEST_ID, remote_context, shared_ms_to_ns, tracer
from vramguard.worker.batch.entries import Entry
from vramguard.worker.memory.budget import MemoryBudget

Attributes = dict[str, str | int | float | bool]


def record_queued(entries: Iterable[Entry], batch_start_ms: int, worker_id: str) -> None:
    """One `vramguard.queued` span per traced entry of a batch that starts at `batch_start_ms`
    (shared clock, epoch ms)."""
    active = tracer()
    if active is None:
        return
    end_ns = shared_ms_to_ns(batch_start_ms)
    for entry in entries:
        msg = entry.message
        parent = remote_context(msg.trace) if msg is not None else None
        if msg is None or parent is None:
            continue
        span = active.start_span("vramguard.queued", context=parent, start_time=shared_ms_to_ns(msg.enqueued_ms),
                                 attributes={ATTR_MODEL: msg.model, ATTR_REQUEST_ID: msg.request_id,
                                             "vramguard.worker_id": worker_id, "vramguard.entry_id": entry.entry_id,
                                             "vramguard.delivery_count": entry.delivery_count})
        span.end(end_time=max(end_ns, shared_ms_to_ns(msg.enqueued_ms)))


@dataclass(slots=True)
class GroupTimes:
    """When one cost group ran, epoch ns of this host: its batch started, its forward ran
    [forward_start_ns, forward_end_ns), its replies were published [publish_start_ns, publish_end_ns)."""

    batch_start_ns: int
    forward_start_ns: int = 0
    forward_end_ns: int = 0
    publish_start_ns: int = 0
    publish_end_ns: int = 0


def plan_attributes(budget: MemoryBudget | None, batch_size: int, max_item_cost: int) -> Attributes:
    """The memory plan a group ran under: the worker's budget (bytes), the largest batch cost it
    allows now (tokens or items, lowered after OOM), the batch size the plan holds, and the peak the
    plan predicts for this group (bytes). Empty without a plan (no budget measured)."""
    if budget is None or not budget.plan.planned:
        return {}
    return {"vramguard.plan.budget_bytes": budget.plan.budget_bytes,
            "vramguard.plan.max_batch_cost": budget.max_batch_cost or 0,
            "vramguard.plan.planned_batch_size": budget.plan.planned_batch_size,
            "vramguard.plan.predicted_peak_bytes": budget.predicted_peak_bytes(batch_size, max_item_cost)}


def record_group(entries: Sequence[Entry], times: GroupTimes, batch: Attributes, worker_id: str) -> None:
    """For each traced entry of a group: `vramguard.batch` with `batch` as its attributes (size,
    requests, cost, plan) and its children `vramguard.forward` and `vramguard.publish`."""
    active = tracer()
    if active is None:
        return
    from opentelemetry.trace import set_span_in_context

    for entry in entries:
        msg = entry.message
        parent = remote_context(msg.trace) if msg is not None else None
        if msg is None or parent is None:
            continue
        span = active.start_span("vramguard.batch", context=parent, start_time=times.batch_start_ns,
                                 attributes={**batch, ATTR_MODEL: msg.model, ATTR_REQUEST_ID: msg.request_id,
                                             "vramguard.worker_id": worker_id,
                                             "vramguard.delivery_count": entry.delivery_count})
        inside = set_span_in_context(span)
        active.start_span("vramguard.forward", context=inside, start_time=times.forward_start_ns).end(
            end_time=times.forward_end_ns)
        active.start_span("vramguard.publish", context=inside, start_time=times.publish_start_ns).end(
            end_time=times.publish_end_ns)
        span.end(end_time=times.publish_end_ns)
