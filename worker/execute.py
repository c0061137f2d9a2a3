"""Hop 3 (compute): `run_batch` turns a list of items into one result per item: collate,
forward, split, encode, in chunks of at most `max_batch_size` items.

A failure never takes the batch down with it: when a chunk raises, its items are retried one
by one so that only the item that fails gets `model_error`. Runs in a worker thread; never
touches Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from shared.errors import ModelError, VramguardError
from worker.backend import ModelBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
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
    """What run_batch did, for the heartbeat and logs: forwards run and items that failed."""

    forwards: int = 0
    items_failed: int = 0
    largest_forward: int = 0


def run_batch(backend: ModelBackend, items: Sequence[object], max_batch_size: int) -> tuple[list[ItemResult], BatchStats]:
    """Run `items` through `backend`, at most `max_batch_size` per forward.

    Returns one ItemResult per item, in order, and the stats. Never raises for a model
    failure: a failing item gets ModelError's code (or the VramguardError it raised).
    """
    stats = BatchStats()
    results: list[ItemResult] = []
    for start in range(0, len(items), max_batch_size):
        results.extend(_run_chunk(backend, items[start : start + max_batch_size], stats))
    return results, stats


def _run_chunk(backend: ModelBackend, items: Sequence[object], stats: BatchStats) -> list[ItemResult]:
    try:
        return _forward(backend, items, stats)
    except Exception as exc:  # noqa: BLE001 - any model failure is isolated per item below
        if len(items) == 1:
            stats.items_failed += 1
            return [_failure(exc)]
        log.warning("batch forward failed; retrying items one by one", extra={"batch_size": len(items), "error": str(exc)})
        return [result for item in items for result in _run_chunk(backend, [item], stats)]


def _forward(backend: ModelBackend, items: Sequence[object], stats: BatchStats) -> list[ItemResult]:
    outputs = backend.forward(backend.collate(items))
    stats.forwards += 1
    stats.largest_forward = max(stats.largest_forward, len(items))
    per_item = backend.split(outputs, len(items))
    if len(per_item) != len(items):
        raise ModelError(f"{backend.name} returned {len(per_item)} outputs for a batch of {len(items)}")
    return [ItemResult(output=backend.encode(out)) for out in per_item]


def _failure(exc: Exception) -> ItemResult:
    if isinstance(exc, VramguardError):
        return ItemResult(error_code=exc.code, error_message=exc.message)
    log.error("model raised", extra={"error": repr(exc)})
    return ItemResult(error_code=ModelError.code, error_message=f"the model raised {type(exc).__name__}: {exc}")
