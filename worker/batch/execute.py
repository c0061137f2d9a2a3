"""Hop 3 (compute): `run_batch` turns a list of items into one result per item: collate,
forward, split, encode, in chunks that fit the memory budget (items and padded cost).

Failures stay as small as they can be (docs/concepts/architecture.md "Memory"):
- a model failure: the chunk's items are retried one by one, so only the failing item gets
  `model_error`;
- `torch.cuda.OutOfMemoryError`, or an allocation failure of cuBLAS/cuDNN/cuRAND (`is_oom`): free
  the allocator cache, lower the adaptive cap, split the chunk in halves and retry each; an item
  that OOMs alone is retried once with the device to itself (other forwards may have held the
  memory it needed), and if it OOMs then too it gets 413 `input_too_large`;
- a chunk the soft guard finds too large for the budget, even with no other forward running,
  is split the same way before any forward (with concurrent forwards it first waits for room);
- any other CUDA error, or OOM that persists (a one-item probe that fit at warmup OOMs too, with
  the device to itself): `CudaContextLost`, and the worker exits without acking (runner.py).
Runs in a worker thread; never touches Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from vramguard.shared.errors import InputTooLargeError, ModelError, UnavailableError, VramguardError
from vramguard.worker.backend import ModelBackend, is_cuda_error
from vramguard.worker.memory.budget import MemoryBudget
from vramguard.worker.memory.oom import CudaContextLost, is_oom

__all__ = ["BatchStats", "CudaContextLost", "ItemResult", "chunk_by_cost", "is_oom", "run_batch"]

log = logging.getLogger(__name__)


# Not frozen, though never changed: a frozen dataclass's __init__ costs about three times as much
# (one per item).
@dataclass(slots=True)
class ItemResult:
    """One item's wire output, or the error code and message that replaces it."""

    output: object = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None


@dataclass
class BatchStats:
    """What run_batch did, for the heartbeat and logs."""

    forwards: int = 0
    items_failed: int = 0
    largest_forward: int = 0
    oom_events: int = 0
    splits: int = 0  # chunks split in halves (soft guard or OOM)


class _OutOfMemory:
    """Marker returned instead of the OOM exception, so that no traceback (and none of the
    tensors its frames hold) outlives the except block (PyTorch FAQ, "My out of memory exception
    handler can't allocate memory")."""


_OOM = _OutOfMemory()


def chunk_by_cost(costs: Sequence[int], max_batch_size: int, max_batch_cost: int | None) -> list[range]:
    """Consecutive index ranges, each with at most `max_batch_size` items and a padded cost
    (items x largest cost) of at most `max_batch_cost` (None: no cost limit). Order is kept;
    an item costlier than the limit alone gets a range of its own."""
    chunks: list[range] = []
    start, largest = 0, 0
    for i, cost in enumerate(costs):
        n = i - start + 1
        too_many = n > max_batch_size
        too_costly = max_batch_cost is not None and n * max(largest, cost) > max_batch_cost
        if n > 1 and (too_many or too_costly):
            chunks.append(range(start, i))
            start, largest = i, 0
        largest = max(largest, cost)
    if costs:
        chunks.append(range(start, len(costs)))
    return chunks


def run_batch(
    backend: ModelBackend, items: Sequence[object], max_batch_size: int, *,
    budget: MemoryBudget | None = None, costs: Sequence[int] | None = None,
    guard: Callable[[int], AbstractContextManager[object]] | None = None,
) -> tuple[list[ItemResult], BatchStats]:
    """Run `items` through `backend` in chunks of at most `max_batch_size` items (and, with a
    `budget`, its current item cap and cost limit). `costs`: each item's backend.item_cost,
    computed here when not given. `guard(padded_cost)`: a context each forward runs in, given its
    padded cost (items x their largest cost); the hang guard times each forward in it.

    Returns one ItemResult per item, in order, and the stats. Never raises for a model failure
    or an OOM. Raises CudaContextLost when the device can no longer be trusted.
    """
    costs = list(costs) if costs is not None else [backend.item_cost(item) for item in items]
    stats = BatchStats()
    limit, max_cost = max_batch_size, None
    if budget is not None:
        limit, max_cost = min(limit, budget.max_batch_size), budget.max_batch_cost
    compute = _Compute(backend, budget, stats, guard or (lambda _cost: nullcontext()))
    results: list[ItemResult] = []
    for chunk in chunk_by_cost(costs, limit, max_cost):
        results.extend(compute.run([items[i] for i in chunk], [costs[i] for i in chunk]))
    return results, stats


class _Compute:
    def __init__(self, backend: ModelBackend, budget: MemoryBudget | None, stats: BatchStats,
                 guard: Callable[[int], AbstractContextManager[object]]) -> None:
        self.backend = backend
        self.budget = budget
        self.stats = stats
        self.guard = guard

    def run(self, items: list[object], costs: list[int]) -> list[ItemResult]:
        n = len(items)
        with self._admitted(n, max(costs)) as admitted:
            outcome = self._try_forward(items, n * max(costs)) if admitted else None
        if outcome is None:
            log.info("soft guard: predicted peak over the budget; splitting", extra={"batch_size": n})
            return self._halves(items, costs)
        if isinstance(outcome, _OutOfMemory):
            return self._after_oom(items, costs)
        if isinstance(outcome, Exception):
            return self._after_failure(items, costs, outcome)
        if self.budget is not None:
            self.budget.on_success(n)
        return outcome

    def _admitted(self, batch_size: int, max_item_cost: int) -> AbstractContextManager[bool]:
        """The memory budget's soft guard (it waits for concurrent forwards to leave room); always
        admitted without a budget."""
        if self.budget is None:
            return nullcontext(True)
        return self.budget.admit(batch_size, max_item_cost)

    def _try_forward(self, items: list[object], padded_cost: int) -> list[ItemResult] | Exception | _OutOfMemory:
        import torch

        try:
            with self.guard(padded_cost):
                return _forward(self.backend, items, self.stats)
        except torch.cuda.OutOfMemoryError:
            return _OOM
        except Exception as exc:  # noqa: BLE001 - classified here and by the caller
            if is_oom(exc):
                return _OOM
            return exc

    def _halves(self, items: list[object], costs: list[int]) -> list[ItemResult]:
        self.stats.splits += 1
        if self.budget is not None:
            self.budget.on_split()
        mid = len(items) // 2
        return self.run(items[:mid], costs[:mid]) + self.run(items[mid:], costs[mid:])

    def _after_oom(self, items: list[object], costs: list[int]) -> list[ItemResult]:
        self.stats.oom_events += 1
        if self.budget is not None:
            self.budget.on_oom(len(items))
        log.warning("out of memory; cache freed", extra={"batch_size": len(items), "item_cost": max(costs)})
        if len(items) > 1:
            return self._halves(items, costs)
        with self._alone():
            outcome = self._try_forward(items, costs[0])
            if isinstance(outcome, Exception):
                return self._after_failure(items, costs, outcome)
            if not isinstance(outcome, _OutOfMemory):
                if self.budget is not None:
                    self.budget.on_success(1)
                return outcome
            self._check_context()
        self.stats.items_failed += 1
        message = f"the input (cost {costs[0]}) does not fit the worker's memory budget even alone"
        return [ItemResult(error_code=InputTooLargeError.code, error_message=message)]

    def _alone(self) -> AbstractContextManager[None]:
        """The device to this thread alone (MemoryBudget.exclusive); nothing to wait for without a budget."""
        return self.budget.exclusive() if self.budget is not None else nullcontext()

    def _check_context(self) -> None:
        """OOM that persists: a one-item probe of the smallest cost (it fit at warmup) must still run.
        Called with the device to itself (`_alone`), so a neighbour forward cannot make it fail."""
        probe = self._try_forward([self.backend.sample_item(1)], 1)
        if isinstance(probe, _OutOfMemory):
            raise CudaContextLost("out of memory persists: a one-item probe no longer fits")
        if isinstance(probe, Exception) and is_cuda_error(probe):
            raise CudaContextLost(f"CUDA error in the probe: {probe}") from probe

    def _after_failure(self, items: list[object], costs: list[int], exc: Exception) -> list[ItemResult]:
        if is_cuda_error(exc):
            raise CudaContextLost(str(exc)) from exc
        if isinstance(exc, UnavailableError):  # an engine the model calls is down: no item is to blame, no retry
            self.stats.items_failed += len(items)
            return [_failure(exc) for _ in items]
        if len(items) == 1:
            self.stats.items_failed += 1
            return [_failure(exc)]
        log.warning("batch forward failed; retrying items one by one",
                    extra={"batch_size": len(items), "error": str(exc)})
        return [r for item, cost in zip(items, costs, strict=True) for r in self.run([item], [cost])]


def _forward(backend: ModelBackend, items: Sequence[object], stats: BatchStats) -> list[ItemResult]:
    outputs = backend.forward(backend.collate(items))
    stats.forwards += 1
    stats.largest_forward = max(stats.largest_forward, len(items))
    per_item = backend.split(outputs, len(items))
    if len(per_item) != len(items):
        raise ModelError(f"{backend.name} returned {len(per_item)} outputs for a batch of {len(items)}")
    return [ItemResult(output=backend.encode(item, out)) for item, out in zip(items, per_item, strict=True)]


def _failure(exc: Exception) -> ItemResult:
    if isinstance(exc, VramguardError):
        return ItemResult(error_code=exc.code, error_message=exc.message)
    log.error("model raised", extra={"error": repr(exc)})
    return ItemResult(error_code=ModelError.code, error_message=f"the model raised {type(exc).__name__}: {exc}")
