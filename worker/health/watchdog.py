"""The worker's watchdog: is this worker still able to compute?

Two signals: an idle probe (a tiny forward through the backend's example inputs once the
worker has served nothing for `probe_interval_s`) and the run of consecutive failed batches
(every item failed with model_error; `max_consecutive_failed_batches`). Failed batches alone
prove nothing (five bad inputs in a row look the same), so that run triggers a probe on the
known-good inputs; only a failing probe (a CUDA error above all) marks the worker unhealthy for good: its
heartbeat says so, it stops reading and exits ExitCode.UNHEALTHY so supervisor restarts it
with a fresh CUDA context. A worker never reports healthy again after its device broke.
Never touches Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

from vramguard.shared.clock import monotonic_ms, now_ms
from vramguard.shared.errors import ModelError, UnavailableError
from vramguard.shared.settings import Settings
from vramguard.worker.backend import ModelBackend
from vramguard.worker.batch.execute import ItemResult
from vramguard.worker.health.hang import HangGuard
from vramguard.worker.memory.oom import is_oom
from vramguard.worker.modelthreads import ModelThreads

log = logging.getLogger(__name__)


class Watchdog:
    """Probes `backend` when idle and counts failed batches; calls `on_unhealthy(reason)` once.

    `last_ok_ms` (epoch ms of the last successful probe, warmup or batch) is what the gateway's
    readiness checks for recency (gateway/observe/health.py).
    """

    def __init__(
        self, settings: Settings, backend: ModelBackend, on_unhealthy: Callable[[str], None],
        *, threads: ModelThreads, hang: HangGuard | None = None,
    ) -> None:
        self._backend = backend
        self._threads = threads
        self._hang = hang or HangGuard(lambda *_: None)
        self._on_unhealthy = on_unhealthy
        self._interval_ms = settings.probe_interval_s * 1000
        self._max_failed = settings.max_consecutive_failed_batches
        self._fault = settings.probe_fault if settings.fault_injection else "none"
        self._last_activity_ms = monotonic_ms()
        self.last_ok_ms = 0
        self.probes = 0
        self.probe_failures = 0
        self.failed_in_row = 0
        self.unhealthy_reason: str | None = None
        # Set once the memory budget exists (MemoryBudget.exclusive): the probe then waits for the
        # device to be its own, so a forward running next to it cannot make it fail.
        self.guard: Callable[[], AbstractContextManager[object]] = nullcontext

    def __repr__(self) -> str:
        return (f"<Watchdog probes={self.probes} probe_failures={self.probe_failures} "
                f"failed_in_row={self.failed_in_row} unhealthy={self.unhealthy_reason!r}>")

    def mark_ok(self) -> None:
        """The backend just computed correctly (warmup, a probe or a batch)."""
        self.last_ok_ms = now_ms()
        self._last_activity_ms = monotonic_ms()

    def record_batch(self, results: Sequence[ItemResult]) -> None:
        """Count a batch: failed when it had items and every one failed with model_error
        (invalid inputs and expired deadlines are the client's, not the device's)."""
        if not results:
            return
        self._last_activity_ms = monotonic_ms()
        if all(r.error_code == ModelError.code for r in results):
            self.failed_in_row += 1  # verify_due tells the caller to probe
            return
        self.failed_in_row = 0
        if any(r.ok for r in results):
            self.mark_ok()

    @property
    def probe_due(self) -> bool:
        """True when healthy and nothing was computed for `probe_interval_s`."""
        return self.unhealthy_reason is None and monotonic_ms() - self._last_activity_ms >= self._interval_ms

    @property
    def verify_due(self) -> bool:
        """True when `max_consecutive_failed_batches` batches in a row failed: call `verify`."""
        return self.unhealthy_reason is None and self.failed_in_row >= self._max_failed

    async def verify(self) -> bool:
        """Probe the known-good inputs after a run of failed batches. Passing: the inputs were
        at fault, the run is forgotten. Failing: unhealthy, naming both. Returns whether it passed."""
        failed = self.failed_in_row
        passed = await self.probe(context=f"after {failed} consecutive batches failed")
        if passed:
            self.failed_in_row = 0
            log.warning("batches failed but the probe passed: the inputs were at fault", extra={"batches": failed})
        return passed

    async def probe(self, context: str = "") -> bool:
        """Run one probe forward on a model thread; returns whether it passed. A failure marks the
        worker unhealthy (never raises); `context` prefixes the reason."""
        self.probes += 1
        started = monotonic_ms()
        try:
            with self._hang.forward("probe"):
                await self._threads.run(self._forward)
        except UnavailableError as exc:
            # An engine the model calls is down: this worker's own machinery works (it reached the engine
            # and mapped the failure), and a restart would not bring the engine back. It stays live, so
            # each request gets a 503 naming the engine, and is served again as soon as the engine is back.
            self.mark_ok()
            log.warning("probe: a service the model needs is unavailable", extra={"error": exc.message})
            return False
        except Exception as exc:  # noqa: BLE001 - any failure on known-good inputs means a broken model or device
            self.probe_failures += 1
            cuda = "CUDA" in str(exc) or type(exc).__name__ in {"AcceleratorError", "OutOfMemoryError"} or is_oom(exc)
            log.error("probe failed", extra={"error": repr(exc), "cuda_error": cuda})
            self._fail(f"{context + ': ' if context else ''}probe failed: {type(exc).__name__}: {exc}")
            return False
        self.mark_ok()
        log.debug("probe passed", extra={"duration_ms": round(monotonic_ms() - started, 2)})
        return True

    def _forward(self) -> None:
        with self.guard():
            self._probe_forward()

    def _probe_forward(self) -> None:
        inputs: list[object] = self._backend.example_inputs() if self._fault == "none" else [{"fault": self._fault}]
        items = self._backend.decode(inputs, {})
        outputs = self._backend.forward(self._backend.collate(items))
        if len(self._backend.split(outputs, len(items))) != len(items):
            raise ModelError("probe returned the wrong number of outputs")

    def _fail(self, reason: str) -> None:
        if self.unhealthy_reason is None:
            self.unhealthy_reason = reason
            self._on_unhealthy(reason)

    def heartbeat_fields(self) -> dict[str, object]:
        """Watchdog fields of shared.heartbeat.WorkerBeat (gateway/observe/health.py reads `healthy`, `last_ok_ms` and
        `probe_interval_ms`)."""
        return {
            "healthy": self.unhealthy_reason is None,
            "unhealthy_reason": self.unhealthy_reason or "",
            "last_ok_ms": self.last_ok_ms,
            "probe_interval_ms": int(self._interval_ms),
            "probes": self.probes,
            "probe_failures": self.probe_failures,
            "failed_batches_in_row": self.failed_in_row,
        }
