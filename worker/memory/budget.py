"""The memory budget at run time (docs/concepts/architecture.md "Memory"): open the device's accounting, register
this worker's share of its GPU, measure its forwards and plan (worker/memory/plan.py), then keep every
forward inside the plan: the soft guard admits concurrent forwards against the budget, the
adaptive cap learns from OOMs. torch is imported only here, in accounting.py and backends.
Never touches Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.backend import ModelBackend
from vramguard.worker.memory import mirror
from vramguard.worker.memory.accounting import MemoryAccounting, SimAccounting, open_accounting
from vramguard.worker.memory.ledger import DeviceLedger, PlacementError, ledger_dir
from vramguard.worker.memory.oom import CudaContextLost
from vramguard.worker.memory.plan import (
    AdaptiveCap,
    Fit,
    MemoryPlanError,
    Plan,
    Sample,
    fit_peak,
    measurement_grid,
    plan_budget,
    replan,
    unplanned,
)

__all__ = ["AdaptiveCap", "MemoryBudget", "MemoryPlanError", "build_plan", "cap_allocator", "measure_samples",
           "start_budget"]


def measure_samples(
    backend: ModelBackend, accounting: MemoryAccounting, grid: Sequence[tuple[int, int]],
    on_step: Callable[[], None] = lambda: None,
) -> list[Sample]:
    """Run one forward per grid point and record its peak (reset_peak_memory_stats, then
    max_memory_allocated, as https://pytorch.org/docs/stable/notes/cuda.html suggests) and the
    segments it made the allocator reserve (max_memory_reserved, from an emptied cache): a forward
    of 2-10 MiB takes a 20 MiB segment, and the cap binds on reserved memory.

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
        accounting.empty_cache()
        before, reserved_before = accounting.allocated_bytes(), accounting.reserved_bytes()
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
        samples.append(Sample(batch_size, item_cost, accounting.peak_bytes() - before,
                              accounting.max_reserved_bytes() - reserved_before))
    if not samples:
        raise MemoryPlanError("even one item ran out of memory while measuring")
    return samples


class MemoryBudget:
    """A worker's plan at run time: the soft guard, the adaptive cap, the OOM bookkeeping and the
    heartbeat fields. Safe under concurrent forwards (Settings' max_inflight_batches > 1): every
    forward is admitted against the budget with its predicted peak reserved until it ends, and all
    counters change under one lock."""

    def __init__(self, plan: Plan, accounting: MemoryAccounting, *, success_run: int = 16) -> None:
        self.plan = plan
        self.accounting = accounting
        self.cap = AdaptiveCap(plan.planned_batch_size, success_run)
        self.oom_events = 0
        self.batch_splits = 0
        self.largest_forward = 0  # items in the largest forward that ran (tests: never over the plan)
        self.max_concurrent_forwards = 0  # most forwards admitted at once (<= plan.inflight_batches when planned)
        self.cache_releases = 0  # empty_cache calls the soft guard made before a forward to stay under the cap
        # On the CPU the resident set already counts the context; elsewhere it lives outside the allocator.
        context = 0 if accounting.kind == "cpu" else plan.context_bytes
        self.limit_bytes = plan.budget_bytes - context
        self._cond = threading.Condition()
        self._exclusive_held = False  # a probe or a retry has the device to itself
        self._exclusive_waiting = 0  # ... or waits for it: no new forward is admitted meanwhile
        self._inflight = 0
        self._reserved_bytes = 0  # predicted peaks of the forwards running now
        # The weights' segments count whole (plan.weights_bytes): the free rest of a weights' segment
        # cannot be counted on by a forward of another size.
        self._weights_slack = max(0, plan.weights_bytes - accounting.allocated_bytes())
        self._resting_bytes = accounting.allocated_bytes() + self._weights_slack  # with no forward running

    @property
    def max_batch_size(self) -> int:
        """Items per forward now: the adaptive cap (<= the plan's planned_batch_size)."""
        return self.cap.value

    @property
    def max_batch_cost(self) -> int | None:
        """Cost per forward now (tokens for text, items otherwise), scaled by the adaptive cap;
        None without a plan."""
        if not self.plan.planned:
            return None
        return max(1, self.plan.max_batch_cost * self.cap.value // max(1, self.plan.planned_batch_size))

    @property
    def running_forwards(self) -> int:
        """Forwards admitted by `admit` whose block has not ended yet."""
        with self._cond:
            return self._inflight

    def fits_alone(self, item_cost: int) -> bool:
        """Whether one item of `item_cost` fits the planned budget at all (else: 413 at once)."""
        return not self.plan.planned or item_cost <= self.plan.max_batch_cost

    def predicted_peak_bytes(self, batch_size: int, max_item_cost: int) -> int:
        """fixed + per_unit x padded cost; 0 without a plan."""
        fit = Fit(self.plan.fixed_bytes, self.plan.per_unit_bytes)
        return fit.predict(batch_size * max_item_cost) if self.plan.planned else 0

    def fits(self, batch_size: int, max_item_cost: int) -> bool:
        """The soft guard's test: memory at rest + the peaks reserved by running forwards + this
        forward's predicted peak <= the budget (always True without a plan)."""
        if not self.plan.planned:
            return True
        with self._cond:
            return self._fits_locked(self.predicted_peak_bytes(batch_size, max_item_cost))

    def _fits_locked(self, predicted: int) -> bool:
        if self._inflight == 0:
            self._resting_bytes = self._resting_now()
        return self._resting_bytes + self._reserved_bytes + predicted <= self.limit_bytes

    def _resting_now(self) -> int:
        """What the allocator holds with no forward running (bytes): its reserved segments, cached
        ones included, since the cap binds on reserved bytes and a segment pinned by one lasting
        block cannot be given back; never less than the live bytes plus the weights' whole segments."""
        return max(self.accounting.allocated_bytes() + self._weights_slack, self.accounting.reserved_bytes())

    def _make_room_locked(self, predicted: int) -> None:
        """With no forward running: when the cached segments and this forward's predicted peak
        would pass the cap, give the cache back first (empty_cache), the release-and-retry the
        OOM path does, done before the forward. The plan's peaks were measured from an emptied
        cache; a forward that starts in segments cached by a batch of another size may place its
        blocks in them so that it needs a new segment the cap no longer holds."""
        resting = self._resting_now()
        if resting + predicted > self.limit_bytes and self.accounting.reserved_bytes() > \
                self.accounting.allocated_bytes():
            self.accounting.empty_cache()
            self.cache_releases += 1

    @contextmanager
    def admit(self, batch_size: int, max_item_cost: int) -> Iterator[bool]:
        """The soft guard for one forward: wait while running forwards leave too little room, then
        reserve its predicted peak until the block ends. Yields False when it cannot fit even with
        no other forward running (the caller splits it); a single item is then admitted anyway,
        since it was found to fit alone (`fits_alone`)."""
        predicted = self.predicted_peak_bytes(batch_size, max_item_cost)
        with self._cond:
            while self._exclusive_held or self._exclusive_waiting or (
                    not self._fits_locked(predicted) and self._inflight > 0):
                self._cond.wait()
            if self._inflight == 0 and self.plan.planned:
                self._make_room_locked(predicted)
            admitted = batch_size == 1 or self._fits_locked(predicted)
            if admitted:
                self._inflight += 1
                self._reserved_bytes += predicted
                self.max_concurrent_forwards = max(self.max_concurrent_forwards, self._inflight)
        try:
            yield admitted
        finally:
            if admitted:
                with self._cond:
                    self._inflight -= 1
                    self._reserved_bytes -= predicted
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The device to this block alone: wait until no admitted forward runs, and admit none until
        the block ends. For what must not run next to other forwards: the probe that decides the
        context is lost or the worker unhealthy, and the retry of one item after an OOM (with
        Settings' max_inflight_batches > 1 a neighbour forward may have held the memory it needed).
        Not reentrant: a block must not call it again."""
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._inflight > 0 or self._exclusive_held:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive_held = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive_held = False
                self._cond.notify_all()

    def on_split(self) -> None:
        """A batch was split in halves (soft guard or OOM)."""
        with self._cond:
            self.batch_splits += 1

    def on_oom(self, batch_size: int) -> None:
        """After an OutOfMemoryError (outside its except block): free the cache, lower the cap."""
        with self._cond:
            self.oom_events += 1
            self.cap.on_oom(batch_size)
        self.accounting.empty_cache()

    def on_success(self, batch_size: int) -> None:
        """After a forward of `batch_size` items that ran without OOM."""
        with self._cond:
            self.largest_forward = max(self.largest_forward, batch_size)
            self.cap.on_success()

    def heartbeat_fields(self) -> dict[str, object]:
        """The memory fields of shared.heartbeat.WorkerBeat."""
        a, p = self.accounting, self.plan
        return {
            "device_kind": a.kind, "mem_total_bytes": a.total_bytes(), "mem_allocated_bytes": a.allocated_bytes(),
            "mem_reserved_bytes": a.reserved_bytes(), "mem_peak_bytes": a.peak_bytes(),
            "mem_budget_bytes": p.budget_bytes, "mem_cap_bytes": p.cap_bytes, "mem_outside_bytes": a.context_bytes(),
            "mem_max_reserved_bytes": a.max_reserved_bytes(), "oom_events": self.oom_events,
            "batch_splits": self.batch_splits,
            "adaptive_batch_cap": self.cap.value, "largest_forward": self.largest_forward,
            "max_concurrent_forwards": self.max_concurrent_forwards,
            "memory_share": p.memory_share, "gpu_uuid": a.device_uuid(),
            "plan_context_bytes": p.context_bytes, "plan_weights_bytes": p.weights_bytes,
            "plan_fixed_bytes": p.fixed_bytes, "plan_per_item_bytes": p.per_item_bytes,
            "plan_per_token_bytes": round(p.per_token_bytes, 3), "plan_batch_size": p.planned_batch_size,
            "plan_batch_tokens": p.planned_batch_tokens, "plan_inflight_batches": p.inflight_batches,
        }


def build_plan(
    backend: ModelBackend, accounting: MemoryAccounting, settings: Settings, config: ModelConfig, *,
    context_bytes: int, weights_bytes: int, total_bytes: int | None = None, on_step: Callable[[], None] = lambda: None,
    memory_share: float | None = None,
) -> Plan:
    """Measure (when Settings.memory_planner is on) and plan for a loaded, warmed-up backend, in
    this worker's share (`memory_share`, else Settings.effective_memory_share), for the model's
    batching settings `config` (max_batch_size, max_inflight_batches). `total_bytes` plans for a
    device of that size instead of this one (worker.profile --total-bytes).

    Raises MemoryPlanError when the budget cannot hold one item.
    """
    common = dict(device_kind=accounting.kind, total_bytes=total_bytes or accounting.total_bytes(),
                  context_bytes=context_bytes, weights_bytes=weights_bytes, max_item_cost=backend.max_item_cost,
                  watermark=settings.watermark, memory_share=memory_share or settings.effective_memory_share,
                  max_batch_size=config.max_batch_size, max_inflight_batches=config.max_inflight_batches)
    if not settings.memory_planner:
        return unplanned(**common)  # type: ignore[arg-type]
    # A generative model's step is one packed row of up to max_item_cost tokens (worker/generate/engine.py):
    # its batch sizes would measure padded batches it never runs.
    rows = 1 if hasattr(backend, "forward_step") else config.max_batch_size
    grid = measurement_grid(backend.max_item_cost, rows)
    fit = fit_peak(measure_samples(backend, accounting, grid, on_step))
    return plan_budget(fit=fit, **common)  # type: ignore[arg-type]


def device_ledger(accounting: MemoryAccounting, folder: Path) -> DeviceLedger | None:
    """The ledger where this worker registers its share: its simulated GPU's, or its real GPU's
    (by UUID, so an index and a UUID naming one GPU agree); None on the CPU or an unpinned sim."""
    if isinstance(accounting, SimAccounting):
        return accounting.device.ledger
    uuid = accounting.device_uuid()
    return DeviceLedger(folder, uuid) if uuid else None


def cap_allocator(accounting: MemoryAccounting, budget_bytes: int) -> int:
    """Cap this process's caching allocator at its budget less its memory outside the allocator, as
    measured now (torch.cuda.set_per_process_memory_fraction). Returns that outside figure (bytes).
    Raises MemoryPlanError when the outside memory alone fills the budget."""
    outside = accounting.context_bytes() if accounting.kind != "cpu" else 0
    total = accounting.total_bytes()
    if budget_bytes - outside <= 0:
        raise MemoryPlanError(f"memory budget {budget_bytes / 2**20:.1f} MiB cannot even hold this process's "
                              f"memory outside the allocator ({outside / 2**20:.1f} MiB: CUDA context, kernel modules)")
    accounting.limit_fraction((budget_bytes - outside) / total)
    return outside


def load_weights(backend: ModelBackend, accounting: MemoryAccounting, share: float) -> int:
    """backend.load() under the cap; returns the weights' bytes: allocated after - before, or the
    segments they keep reserved once the cache is emptied when that is more (a weight of 8 MiB
    holds a 20 MiB segment). On the simulated GPU, parameters and buffers the allocation mirror did not
    see made are adopted where they live (worker/memory/mirror.py). Raises MemoryPlanError when they
    do not fit the share."""
    import torch

    before, reserved_before = accounting.allocated_bytes(), accounting.reserved_bytes()
    try:
        backend.load()
        if (active := mirror.active()) is not None:
            active.adopt_modules(backend)
    except torch.cuda.OutOfMemoryError:
        raise MemoryPlanError(
            f"the weights do not fit: out of device memory while loading them (device {accounting.total_bytes()} "
            f"bytes, this worker's share {share:g} = {int(share * accounting.total_bytes())} bytes less its "
            "memory outside the allocator)") from None
    accounting.empty_cache()
    return max(0, accounting.allocated_bytes() - before, accounting.reserved_bytes() - reserved_before)


def warm_up_within(warm_up: Callable[[], None], accounting: MemoryAccounting, budget_bytes: int, weights: int) -> None:
    """Run the warmup under the cap. Raises MemoryPlanError when it runs out of memory even one item
    at a time (the budget cannot hold the model: a placement problem, not a lost context)."""
    try:
        warm_up()
    except CudaContextLost as exc:
        if "out of memory" not in str(exc):
            raise
        outside = accounting.context_bytes() if accounting.kind != "cpu" else 0
        raise MemoryPlanError(
            f"memory budget {budget_bytes / 2**20:.1f} MiB cannot hold the warmup's forward next to this "
            f"process's memory outside the allocator and its weights ({(outside + weights) / 2**20:.1f} MiB)"
        ) from None


def start_budget(
    backend: ModelBackend, settings: Settings, config: ModelConfig, *, warm_up: Callable[[], None] = lambda: None,
    total_bytes: int | None = None, on_step: Callable[[], None] = lambda: None, register: bool = True,
) -> MemoryBudget:
    """A worker's start, in docs/concepts/architecture.md's order ("Memory"), so that nothing is reserved above the
    cap at any time:
    open the device's accounting (creating the simulated device for "sim"), register this worker's
    share in its GPU's ledger (unless not `register`: worker.profile plans without serving), check
    that the GPU has the budget free (worker/memory/freemem.py), cap the allocator at the budget less the
    context, load the weights, `warm_up`, re-cap with the context measured again (kernel modules
    load lazily), measure under that cap, empty the cache the measuring left, measure the context a
    last time after those full-size forwards and plan with it, cap at the plan's `memory_fraction`
    and reset the peaks for serving.

    Raises PlacementError (worker/memory/ledger.py) when the share would over-commit the GPU or the GPU
    does not have it free, MemoryPlanError when the weights or one item do not fit; what else
    backend.load raises.
    """
    folder = ledger_dir(settings.device_ledger_dir)
    device = "sim" if settings.device == "sim" or backend.device == "sim" else backend.device
    accounting = open_accounting(device, settings.sim_memory_bytes, settings.cuda_visible_devices, folder,
                                 sim_context_bytes=settings.sim_context_bytes,
                                 sim_module_bytes=settings.sim_module_bytes)
    if isinstance(accounting, SimAccounting) and backend.device != "sim":  # a real model on the simulated GPU
        mirror.install(accounting.device)
    else:
        mirror.uninstall()
    with mirror.scope():
        return _start(backend, settings, config, accounting, folder, warm_up=warm_up, total_bytes=total_bytes,
                      on_step=on_step, register=register)


def _start(
    backend: ModelBackend, settings: Settings, config: ModelConfig, accounting: MemoryAccounting, folder: Path, *,
    warm_up: Callable[[], None], total_bytes: int | None, on_step: Callable[[], None], register: bool,
) -> MemoryBudget:
    """start_budget's steps once the accounting is open (and, on the simulated GPU, mirrored)."""
    from vramguard.worker.memory.freemem import check_free_memory

    ledger = device_ledger(accounting, folder) if register else None
    if ledger is not None:
        ledger.register_share(settings.effective_memory_share, settings.watermark)
    share = settings.effective_memory_share
    if register and accounting.kind != "cpu":
        try:
            share = check_free_memory(accounting, settings, share, ledger)
        except PlacementError:
            if ledger is not None:
                ledger.release()  # a worker that does not start holds no share
            raise
    budget_bytes = int(share * (total_bytes or accounting.total_bytes()))
    on_cpu = accounting.kind == "cpu"
    resident = accounting.context_bytes()  # on the CPU: the resident set before the weights
    if total_bytes is None:
        cap_allocator(accounting, budget_bytes)
    weights = load_weights(backend, accounting, share)
    warm_up_within(warm_up, accounting, budget_bytes, weights)
    if on_cpu:
        context = resident
    else:
        context = cap_allocator(accounting, budget_bytes) if total_bytes is None else accounting.context_bytes()
    plan = build_plan(backend, accounting, settings, config, context_bytes=context, weights_bytes=weights,
                      total_bytes=total_bytes, on_step=on_step, memory_share=share)
    accounting.empty_cache()
    if not on_cpu:  # kernel modules for the full-size forwards load lazily, outside the allocator; what stays
        # reserved now (the weights' segments, cuBLAS's workspace, small segments lasting tensors pin) is what
        # every forward starts from, and the cap binds on reserved bytes
        plan = replan(plan, accounting.context_bytes(), accounting.reserved_bytes())
    if total_bytes is None:
        accounting.limit_fraction(plan.memory_fraction)
    accounting.reset_peak()
    if ledger is not None and not isinstance(accounting, SimAccounting):  # the simulator records it itself
        ledger.record_held(accounting.reserved_bytes(), accounting.context_bytes())
    return MemoryBudget(plan, accounting, success_run=settings.adaptive_success_run)
