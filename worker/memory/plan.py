"""The memory plan's arithmetic (docs/concepts/architecture.md "Memory"): fit peak = fixed + per_unit x cost to the
measured forwards, then derive from this worker's share of its device how large one forward may
be and how many may run at once. Pure numbers: no torch, no device, no Redis; worker/memory/budget.py
measures and enforces, this module decides.

Cost is the model's own unit (`ModelBackend.item_cost`): 1 per item for fixed-size inputs, tokens
for text, where a forward costs items x its longest item (padding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

# "a few batch sizes" (docs/concepts/architecture.md "Memory"); the fit extrapolates beyond
MEASURE_BATCH_SIZES = (1, 2, 4, 8)
MAX_WORKERS_PER_GPU = 64
UNLIMITED_COST = 1 << 31  # a fit with no per-unit memory: the configured max_batch_size is the only bound


class MemoryPlanError(RuntimeError):
    """The budget cannot hold even one item of the smallest cost (the worker cannot start)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured forward: `batch_size` items of `item_cost` each; `peak_bytes` is the peak
    allocated during the forward above what was allocated before it (activations, workspace);
    `reserved_bytes` the segments it made the allocator reserve from an emptied cache (None: not
    measured), which may be more (a forward of 2-10 MiB takes a 20 MiB segment)."""

    batch_size: int
    item_cost: int
    peak_bytes: int
    reserved_bytes: int | None = None

    @property
    def cost(self) -> int:
        return self.batch_size * self.item_cost


@dataclass(frozen=True, slots=True)
class Fit:
    """peak(cost) = fixed_bytes + per_unit_bytes x cost, an upper envelope of the samples."""

    fixed_bytes: int
    per_unit_bytes: float

    def predict(self, cost: int) -> int:
        return int(math.ceil(self.fixed_bytes + self.per_unit_bytes * cost))


def fit_peak(samples: Sequence[Sample]) -> Fit:
    """Least-squares line through (cost, peak_bytes) (numpy.polyfit), then the intercept raised
    until no sample lies above the line, its reserved bytes included, so the fit never
    under-predicts a measured batch nor the segments it took (the slope comes from the allocated
    peaks: the segment sizes are a step function of the request, not a line).

    A negative slope (measurement noise, e.g. CPU RSS) is clamped to 0. With one distinct cost
    all memory is charged per unit (fixed 0), the conservative reading. Raises ValueError for no samples.
    """
    if not samples:
        raise ValueError("no memory samples to fit")
    costs = np.array([s.cost for s in samples], dtype=np.float64)
    peaks = np.array([max(0, s.peak_bytes) for s in samples], dtype=np.float64)
    reserved = np.array([max(0, s.peak_bytes if s.reserved_bytes is None else s.reserved_bytes) for s in samples],
                        dtype=np.float64)
    if len(set(costs.tolist())) < 2:
        slope = float(np.max(peaks / costs))
        return Fit(int(math.ceil(max(0.0, float(np.max(reserved - slope * costs))))), slope)
    slope, _intercept = np.polyfit(costs, peaks, 1)
    slope = max(0.0, round(float(slope), 6))
    fixed = max(0.0, float(np.max(peaks - slope * costs)), float(np.max(reserved - slope * costs)))
    return Fit(int(math.ceil(fixed)), slope)


@dataclass(frozen=True, slots=True)
class Plan:
    """A worker's measured memory and the limits derived from it (bytes; cost in the model's unit).

    budget_bytes = memory_share x total_bytes (the share is this worker's, never the neighbours');
    room = budget - context - held, where held = max(weights, resting): what stays reserved with no
    forward running, as the per-process cap counts it; each of the `inflight_batches` concurrent forwards gets
    (room / inflight_batches) - fixed, so planned_batch_tokens = floor(that / per_token) for text
    (0 otherwise) and planned_batch_size = min(max_batch_size, floor(that / per_item)).
    `planned` False: the planner is off and planned_batch_size is the configured max_batch_size, unchecked.
    """

    device_kind: str
    total_bytes: int
    context_bytes: int  # this process's own device memory outside the allocator (CUDA context)
    weights_bytes: int
    fixed_bytes: int
    per_item_bytes: int  # per item of the model's largest cost
    per_token_bytes: float  # text models; 0 for fixed-size items
    watermark: float
    memory_share: float  # this worker's fraction of total_bytes
    budget_bytes: int
    max_batch_size: int  # configured (Settings): the cap the plan never exceeds
    planned_batch_size: int  # items per forward the budget holds
    planned_batch_tokens: int  # text: padded tokens per forward; 0 for fixed-size items
    max_item_cost: int
    inflight_batches: int  # concurrent forwards planned (<= the configured max_inflight_batches)
    recommended_workers_per_gpu: int
    planned: bool = True
    # Reserved with no forward running and the cache emptied (0: not measured): the weights' segments,
    # cuBLAS's workspace, the small-pool segments that lasting tensors pin. The cap binds on reserved
    # bytes, so a forward's room is what this leaves, not what the weights alone leave.
    resting_bytes: int = 0

    @property
    def per_unit_bytes(self) -> float:
        return self.per_token_bytes if self.max_item_cost > 1 else float(self.per_item_bytes)

    @property
    def max_batch_cost(self) -> int:
        """The cost one forward may have: tokens for text, items otherwise."""
        return self.planned_batch_tokens if self.max_item_cost > 1 else self.planned_batch_size

    @property
    def cap_bytes(self) -> int:
        """What the caching allocator may reserve (segments, cached blocks included): the budget
        less this process's memory outside the allocator (context, kernel modules), which the
        per-process fraction does not cover. Never below 0."""
        return max(0, self.budget_bytes - self.context_bytes)

    @property
    def memory_fraction(self) -> float:
        """The hard cap handed to torch.cuda.set_per_process_memory_fraction:
        (memory_share x total - outside the allocator) / total, never 0 (torch refuses it)."""
        return max(1e-9, self.cap_bytes / self.total_bytes)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _whole_bytes(value: float) -> int:
    """Round up to whole bytes, ignoring float noise of the fit (8388608.0000001 -> 8388608)."""
    return int(math.ceil(value - 1e-6))


def forward_cost(room_bytes: float, fit: Fit, inflight: int) -> int:
    """The largest cost each of `inflight` concurrent forwards may have in `room_bytes` (0: none fits)."""
    per_forward = room_bytes / inflight - fit.fixed_bytes
    if per_forward <= 0:
        return 0
    if fit.per_unit_bytes <= 0:
        return UNLIMITED_COST
    return int(per_forward // fit.per_unit_bytes)


def plan_budget(
    *, device_kind: str, total_bytes: int, context_bytes: int, weights_bytes: int, fit: Fit, max_item_cost: int,
    watermark: float, memory_share: float, max_batch_size: int, max_inflight_batches: int = 1, resting_bytes: int = 0,
) -> Plan:
    """docs/concepts/architecture.md's arithmetic with a share: usable = memory_share x total; room = usable - context
    - max(weights, resting_bytes) (Plan.resting_bytes; bytes); each of K concurrent forwards fits in
    room / K. K starts at `max_inflight_batches` and is lowered until a forward holds one item of the
    largest cost (`max_item_cost`); at K = 1 a forward must hold at least one unit of cost.

    The recommended workers per GPU is the largest n whose share watermark / n still holds a full
    batch of `max_batch_size` items of the largest cost (1 if none does).
    Raises MemoryPlanError when the budget cannot hold one unit of cost.
    """
    budget = memory_share * total_bytes
    held = max(weights_bytes, resting_bytes)
    room = budget - context_bytes - held
    inflight = max_inflight_batches
    while inflight > 1 and forward_cost(room, fit, inflight) < max_item_cost:
        inflight -= 1
    max_cost = forward_cost(room, fit, inflight)
    if max_cost < 1:
        raise MemoryPlanError(
            f"memory budget {budget / 2**20:.1f} MiB (share {memory_share:.4g} of {total_bytes / 2**20:.1f} MiB) "
            f"cannot hold context + weights (or what stays reserved between forwards) + fixed = "
            f"{(context_bytes + held + fit.fixed_bytes) / 2**20:.1f} MiB plus one item"
        )
    full_batch = max_batch_size * max_item_cost
    recommended = max(
        (n for n in range(1, MAX_WORKERS_PER_GPU + 1)
         if forward_cost(watermark * total_bytes / n - context_bytes - held, fit, 1) >= full_batch),
        default=1,
    )
    text = max_item_cost > 1
    return Plan(
        device_kind=device_kind, total_bytes=total_bytes, context_bytes=context_bytes, weights_bytes=weights_bytes,
        fixed_bytes=fit.fixed_bytes, per_item_bytes=_whole_bytes(fit.per_unit_bytes * max_item_cost),
        per_token_bytes=fit.per_unit_bytes if text else 0.0, watermark=watermark, memory_share=memory_share,
        budget_bytes=int(budget), max_batch_size=max_batch_size, planned_batch_size=min(max_batch_size, max_cost),
        planned_batch_tokens=min(max_cost, UNLIMITED_COST) if text else 0,
        max_item_cost=max_item_cost, inflight_batches=inflight, recommended_workers_per_gpu=recommended,
        resting_bytes=resting_bytes,
    )


def unplanned(
    *, device_kind: str, total_bytes: int, context_bytes: int, weights_bytes: int, max_item_cost: int,
    watermark: float, memory_share: float, max_batch_size: int, max_inflight_batches: int = 1,
) -> Plan:
    """The plan when Settings.memory_planner is off: the configured limits, no cost limit."""
    return Plan(
        device_kind=device_kind, total_bytes=total_bytes, context_bytes=context_bytes, weights_bytes=weights_bytes,
        fixed_bytes=0, per_item_bytes=0, per_token_bytes=0.0, watermark=watermark, memory_share=memory_share,
        budget_bytes=int(memory_share * total_bytes), max_batch_size=max_batch_size,
        planned_batch_size=max_batch_size, planned_batch_tokens=0, max_item_cost=max_item_cost,
        inflight_batches=max_inflight_batches, recommended_workers_per_gpu=max(1, round(watermark / memory_share)),
        planned=False,
    )


def measurement_grid(max_item_cost: int, max_batch_size: int) -> list[tuple[int, int]]:
    """(batch_size, item_cost) pairs to measure: a few batch sizes, and for text a quarter of the
    model's window and the full window, smallest first (an OOM ends a row). Fixed-size items are
    measured at every batch size up to the largest of MEASURE_BATCH_SIZES: the segments a forward
    reserves are a step function of its batch (20 MiB segments up to 10 MiB requests), so a batch
    between two measured ones may reserve more than the line through them."""
    sizes = [b for b in MEASURE_BATCH_SIZES if b <= max_batch_size] or [1]
    if max_item_cost == 1:
        sizes = list(range(1, max(sizes) + 1))
    lengths = sorted({max(1, max_item_cost // 4), max_item_cost})
    return [(b, length) for length in lengths for b in sizes]


def replan(plan: Plan, context_bytes: int, resting_bytes: int | None = None) -> Plan:
    """`plan` with this process's memory outside the allocator measured again (`context_bytes`: the
    kernel modules that load lazily at the first full-size forwards) and, when given, what stays
    reserved between forwards (`resting_bytes`, Plan.resting_bytes): the same fit, the limits derived
    anew. Unchanged when the figures are the same. Raises MemoryPlanError as plan_budget does."""
    resting = plan.resting_bytes if resting_bytes is None else resting_bytes
    if context_bytes == plan.context_bytes and resting == plan.resting_bytes:
        return plan
    if not plan.planned:
        return replace(plan, context_bytes=context_bytes, resting_bytes=resting)
    per_unit = plan.per_token_bytes if plan.max_item_cost > 1 else float(plan.per_item_bytes)
    return plan_budget(
        device_kind=plan.device_kind, total_bytes=plan.total_bytes, context_bytes=context_bytes,
        weights_bytes=plan.weights_bytes, fit=Fit(plan.fixed_bytes, per_unit), max_item_cost=plan.max_item_cost,
        watermark=plan.watermark, memory_share=plan.memory_share, max_batch_size=plan.max_batch_size,
        max_inflight_batches=plan.inflight_batches, resting_bytes=resting,
    )


class AdaptiveCap:
    """The worker's batch cap after OOMs: additive increase, multiplicative decrease (AIMD), the
    rule of TCP congestion control (RFC 5681 section 3.1: halve the window on loss, grow it by
    one segment per round trip without loss).

    On an OOM in a forward of n items: cap = max(1, min(cap, n) // 2). After `success_run`
    OOM-free forwards in a row: cap += 1, up to `ceiling` (the planned max_batch_size).
    """

    def __init__(self, ceiling: int, success_run: int) -> None:
        self.ceiling = ceiling
        self.success_run = success_run
        self.value = ceiling
        self._streak = 0

    def on_oom(self, batch_size: int) -> None:
        self.value = max(1, min(self.value, batch_size) // 2)
        self._streak = 0

    def on_success(self) -> None:
        self._streak += 1
        if self._streak >= self.success_run and self.value < self.ceiling:
            self.value += 1
            self._streak = 0
