"""The memory budget (DESIGN.md "Memory"): measure a worker's memory on its own device, fit
peak = fixed + per_unit x cost, derive the batch limits, and keep batches inside them at run
time (soft guard, adaptive cap). torch is imported only here, in accounting.py and backends.

Cost is the model's own unit (`ModelBackend.item_cost`): 1 per item for fixed-size inputs, tokens
for text, where a batch costs items x its longest item (padding). Never touches Redis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from worker.accounting import MemoryAccounting, open_accounting
from worker.backend import ModelBackend

MEASURE_BATCH_SIZES = (1, 2, 4, 8)  # "a few batch sizes" (DESIGN.md); the fit extrapolates beyond
MAX_WORKERS_PER_GPU = 64


class MemoryPlanError(RuntimeError):
    """The budget cannot hold even one item of the smallest cost (the worker cannot start)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured forward: `batch_size` items of `item_cost` each; `peak_bytes` is the peak
    allocated during the forward above what was allocated before it (activations, workspace)."""

    batch_size: int
    item_cost: int
    peak_bytes: int

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
    until no sample lies above the line, so the fit never under-predicts a measured batch.

    A negative slope (measurement noise, e.g. CPU RSS) is clamped to 0. With one distinct cost
    all memory is charged per unit (fixed 0), the conservative reading. Raises ValueError for no samples.
    """
    if not samples:
        raise ValueError("no memory samples to fit")
    costs = np.array([s.cost for s in samples], dtype=np.float64)
    peaks = np.array([max(0, s.peak_bytes) for s in samples], dtype=np.float64)
    if len(set(costs.tolist())) < 2:
        return Fit(0, float(np.max(peaks / costs)))
    slope, _intercept = np.polyfit(costs, peaks, 1)
    slope = max(0.0, round(float(slope), 6))
    fixed = max(0.0, float(np.max(peaks - slope * costs)))
    return Fit(int(math.ceil(fixed)), slope)


@dataclass(frozen=True, slots=True)
class Plan:
    """A worker's measured memory and the batch limits derived from it (bytes; cost in the model's unit).

    budget_bytes = watermark x total_bytes / workers_per_gpu; room = budget - baseline - weights - fixed;
    max_batch_tokens = floor(room / per_token) for text (0 otherwise); max_batch_size = min(cap,
    floor(room / per_item)) for fixed-size items, min(cap, max_batch_tokens) for text.
    `planned` False: the planner is off and max_batch_size is the configured cap, unchecked.
    """

    device_kind: str
    total_bytes: int
    baseline_bytes: int
    weights_bytes: int
    fixed_bytes: int
    per_item_bytes: int  # per item of the model's largest cost
    per_token_bytes: float  # text models; 0 for fixed-size items
    watermark: float
    workers_per_gpu: int
    budget_bytes: int
    max_batch_size_cap: int
    max_batch_size: int
    max_batch_tokens: int
    max_item_cost: int
    memory_fraction: float
    recommended_workers_per_gpu: int
    planned: bool = True

    @property
    def per_unit_bytes(self) -> float:
        return self.per_token_bytes if self.max_item_cost > 1 else float(self.per_item_bytes)

    @property
    def max_batch_cost(self) -> int:
        """The cost one forward may have: tokens for text, items otherwise."""
        return self.max_batch_tokens if self.max_item_cost > 1 else self.max_batch_size

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _whole_bytes(value: float) -> int:
    """Round up to whole bytes, ignoring float noise of the fit (8388608.0000001 -> 8388608)."""
    return int(math.ceil(value - 1e-6))


def _room_cost(budget_bytes: float, used_bytes: int, per_unit: float) -> int:
    room = budget_bytes - used_bytes
    if per_unit <= 0:
        return 1 << 40 if room > 0 else 0
    return max(0, int(room // per_unit))


def plan_budget(
    *, device_kind: str, total_bytes: int, baseline_bytes: int, weights_bytes: int, fit: Fit, max_item_cost: int,
    watermark: float, workers_per_gpu: int, max_batch_size_cap: int,
) -> Plan:
    """DESIGN.md's arithmetic: usable = watermark x total / workers; max_batch = floor((usable -
    baseline - weights - fixed) / per_item), capped by the configured max_batch_size.

    The recommended workers per GPU is the largest K whose share still holds a full batch of
    `max_batch_size_cap` items of the largest cost (1 if none does); its memory fraction is watermark / K.
    Raises MemoryPlanError when the budget cannot hold one unit of cost.
    """
    used = baseline_bytes + weights_bytes + fit.fixed_bytes
    budget = watermark * total_bytes / workers_per_gpu
    max_cost = _room_cost(budget, used, fit.per_unit_bytes)
    if max_cost < 1:
        raise MemoryPlanError(
            f"memory budget {budget / 2**20:.1f} MiB (watermark {watermark} x {total_bytes / 2**20:.1f} MiB / "
            f"{workers_per_gpu} workers) cannot hold baseline + weights + fixed = {used / 2**20:.1f} MiB plus one item"
        )
    text = max_item_cost > 1
    full_batch = max_batch_size_cap * max_item_cost
    recommended = max(
        (k for k in range(1, MAX_WORKERS_PER_GPU + 1)
         if _room_cost(watermark * total_bytes / k, used, fit.per_unit_bytes) >= full_batch),
        default=1,
    )
    return Plan(
        device_kind=device_kind, total_bytes=total_bytes, baseline_bytes=baseline_bytes, weights_bytes=weights_bytes,
        fixed_bytes=fit.fixed_bytes, per_item_bytes=_whole_bytes(fit.per_unit_bytes * max_item_cost),
        per_token_bytes=fit.per_unit_bytes if text else 0.0, watermark=watermark, workers_per_gpu=workers_per_gpu,
        budget_bytes=int(budget), max_batch_size_cap=max_batch_size_cap,
        max_batch_size=min(max_batch_size_cap, max_cost), max_batch_tokens=min(max_cost, 1 << 31) if text else 0,
        max_item_cost=max_item_cost, memory_fraction=watermark / workers_per_gpu,
        recommended_workers_per_gpu=recommended,
    )


def unplanned(
    *, device_kind: str, total_bytes: int, baseline_bytes: int, weights_bytes: int, max_item_cost: int,
    watermark: float, workers_per_gpu: int, max_batch_size_cap: int,
) -> Plan:
    """The plan when Settings.memory_planner is off: the configured max_batch_size, no cost limit."""
    return Plan(
        device_kind=device_kind, total_bytes=total_bytes, baseline_bytes=baseline_bytes, weights_bytes=weights_bytes,
        fixed_bytes=0, per_item_bytes=0, per_token_bytes=0.0, watermark=watermark, workers_per_gpu=workers_per_gpu,
        budget_bytes=int(watermark * total_bytes / workers_per_gpu), max_batch_size_cap=max_batch_size_cap,
        max_batch_size=max_batch_size_cap, max_batch_tokens=0, max_item_cost=max_item_cost,
        memory_fraction=watermark / workers_per_gpu, recommended_workers_per_gpu=workers_per_gpu, planned=False,
    )


def measurement_grid(max_item_cost: int, max_batch_size_cap: int) -> list[tuple[int, int]]:
    """(batch_size, item_cost) pairs to measure: a few batch sizes, and for text a quarter of the
    model's window and the full window, smallest first (an OOM ends a row)."""
    sizes = [b for b in MEASURE_BATCH_SIZES if b <= max_batch_size_cap] or [1]
    lengths = sorted({max(1, max_item_cost // 4), max_item_cost})
    return [(b, length) for length in lengths for b in sizes]


def measure_samples(
    backend: ModelBackend, accounting: MemoryAccounting, grid: Sequence[tuple[int, int]],
    on_step: Callable[[], None] = lambda: None,
) -> list[Sample]:
    """Run one forward per grid point and record its peak (reset_peak_memory_stats, then
    max_memory_allocated, as https://pytorch.org/docs/stable/notes/cuda.html suggests).

    A point that raises OutOfMemoryError ends its row (larger batches will not fit either); the
    cache is emptied after the `except` block, per the PyTorch FAQ on OOM recovery. Raises
    MemoryPlanError when no point fits.
    """
    import torch

    samples: list[Sample] = []
    skip_cost: int | None = None
    for batch_size, item_cost in grid:
        on_step()
        if skip_cost == item_cost:
            continue
        items = [backend.sample_item(item_cost) for _ in range(batch_size)]
        before = accounting.allocated_bytes()
        accounting.reset_peak()
        oom = False
        try:
            backend.forward(backend.collate(items))
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:
            accounting.empty_cache()
            skip_cost = item_cost
            continue
        samples.append(Sample(batch_size, item_cost, accounting.peak_bytes() - before))
    if not samples:
        raise MemoryPlanError("even one item ran out of memory while measuring")
    return samples


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


class MemoryBudget:
    """A worker's plan at run time: the current batch limits (the adaptive cap), the soft guard,
    the OOM bookkeeping and the heartbeat fields. Thread-safe enough for one forward at a time;
    counters are only ever incremented."""

    def __init__(self, plan: Plan, accounting: MemoryAccounting, *, success_run: int = 16) -> None:
        self.plan = plan
        self.accounting = accounting
        self.cap = AdaptiveCap(plan.max_batch_size, success_run)
        self.oom_events = 0
        self.batch_splits = 0
        self.largest_forward = 0  # items in the largest forward that ran (tests: never over the plan)
        # On the CPU the RSS already counts the baseline; elsewhere it lives outside the allocator.
        baseline = 0 if accounting.kind == "cpu" else plan.baseline_bytes
        self.limit_bytes = plan.budget_bytes - baseline

    @property
    def max_batch_size(self) -> int:
        """Items per forward now: the adaptive cap (<= the planned max_batch_size)."""
        return self.cap.value

    @property
    def max_batch_cost(self) -> int | None:
        """Cost per forward now (tokens for text, items otherwise), scaled by the adaptive cap;
        None without a plan."""
        if not self.plan.planned:
            return None
        return max(1, self.plan.max_batch_cost * self.cap.value // max(1, self.plan.max_batch_size))

    def fits_alone(self, item_cost: int) -> bool:
        """Whether one item of `item_cost` fits the planned budget at all (else: 413 at once)."""
        return not self.plan.planned or item_cost <= self.plan.max_batch_cost

    def predicted_peak_bytes(self, batch_size: int, max_item_cost: int) -> int:
        """fixed + per_unit x padded cost; 0 without a plan."""
        fit = Fit(self.plan.fixed_bytes, self.plan.per_unit_bytes)
        return fit.predict(batch_size * max_item_cost) if self.plan.planned else 0

    def fits(self, batch_size: int, max_item_cost: int) -> bool:
        """The soft guard: allocated now + predicted peak <= the budget (always True without a plan)."""
        if not self.plan.planned:
            return True
        predicted = self.predicted_peak_bytes(batch_size, max_item_cost)
        return self.accounting.allocated_bytes() + predicted <= self.limit_bytes

    def on_oom(self, batch_size: int) -> None:
        """After an OutOfMemoryError (outside its except block): free the cache, lower the cap."""
        self.oom_events += 1
        self.accounting.empty_cache()
        self.cap.on_oom(batch_size)

    def on_success(self, batch_size: int) -> None:
        """After a forward of `batch_size` items that ran without OOM."""
        self.largest_forward = max(self.largest_forward, batch_size)
        self.cap.on_success()

    def heartbeat_fields(self) -> dict[str, object]:
        """The memory fields of the heartbeat hash (contract with gateway metrics, issue 5)."""
        a, p = self.accounting, self.plan
        return {
            "device_kind": a.kind, "mem_total_bytes": a.total_bytes(), "mem_allocated_bytes": a.allocated_bytes(),
            "mem_reserved_bytes": a.reserved_bytes(), "mem_peak_bytes": a.peak_bytes(),
            "mem_budget_bytes": p.budget_bytes, "oom_events": self.oom_events, "batch_splits": self.batch_splits,
            "adaptive_cap": self.cap.value, "largest_forward": self.largest_forward,
            "plan_baseline_bytes": p.baseline_bytes,
            "plan_weights_bytes": p.weights_bytes, "plan_fixed_bytes": p.fixed_bytes,
            "plan_per_item_bytes": p.per_item_bytes, "plan_per_token_bytes": round(p.per_token_bytes, 3),
            "plan_max_batch_size": p.max_batch_size, "plan_max_batch_tokens": p.max_batch_tokens,
        }


def build_budget(
    backend: ModelBackend, accounting: MemoryAccounting, *, watermark: float, workers_per_gpu: int,
    max_batch_size_cap: int, baseline_bytes: int, weights_bytes: int, planner: bool = True,
    total_bytes: int | None = None, on_step: Callable[[], None] = lambda: None,
) -> Plan:
    """Measure (when `planner`) and plan for a loaded, warmed-up backend. `total_bytes` plans for
    a device of that size instead of this one (worker.profile --total-bytes).

    Raises MemoryPlanError when the budget cannot hold one item.
    """
    common = dict(device_kind=accounting.kind, total_bytes=total_bytes or accounting.total_bytes(),
                  baseline_bytes=baseline_bytes, weights_bytes=weights_bytes, max_item_cost=backend.max_item_cost,
                  watermark=watermark, workers_per_gpu=workers_per_gpu, max_batch_size_cap=max_batch_size_cap)
    if not planner:
        return unplanned(**common)  # type: ignore[arg-type]
    grid = measurement_grid(backend.max_item_cost, max_batch_size_cap)
    fit = fit_peak(measure_samples(backend, accounting, grid, on_step))
    return plan_budget(fit=fit, **common)  # type: ignore[arg-type]


def start_budget(
    backend: ModelBackend, *, sim_memory_bytes: int, watermark: float, workers_per_gpu: int,
    max_batch_size_cap: int, planner: bool, success_run: int, warm_up: Callable[[], None] = lambda: None,
    total_bytes: int | None = None, on_step: Callable[[], None] = lambda: None,
) -> MemoryBudget:
    """A worker's start, in DESIGN.md's order: open the device's accounting (creating the
    simulated device for "sim"), read the baseline, load the weights (their bytes = allocated
    after - before), `warm_up`, measure and plan, then hard-cap the process at the plan's memory
    fraction (torch.cuda.set_per_process_memory_fraction) and reset the peak for serving.

    Raises MemoryPlanError when the weights or one item do not fit; what else backend.load raises.
    """
    import torch

    accounting = open_accounting(backend.device, sim_memory_bytes)
    baseline = accounting.baseline_bytes()
    before = accounting.allocated_bytes()
    try:
        backend.load()
    except torch.cuda.OutOfMemoryError:
        raise MemoryPlanError(f"the weights do not fit the device ({accounting.total_bytes()} bytes)") from None
    weights = max(0, accounting.allocated_bytes() - before)
    warm_up()
    plan = build_budget(
        backend, accounting, watermark=watermark, workers_per_gpu=workers_per_gpu,
        max_batch_size_cap=max_batch_size_cap, baseline_bytes=baseline, weights_bytes=weights, planner=planner,
        total_bytes=total_bytes, on_step=on_step,
    )
    accounting.limit_fraction(plan.memory_fraction)
    accounting.reset_peak()
    return MemoryBudget(plan, accounting, success_run=success_run)
