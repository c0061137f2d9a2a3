"""Hung forwards (a stuck kernel, a deadlock in model code): `HangGuard` times every forward on
the monotonic clock and, when one runs past the model's forward timeout, logs it with the
request ids it held and ends the process at once with ExitCode.FORWARD_HUNG.

A hung thread cannot be cancelled or joined, and the GPU memory it holds is only freed by the
process exiting, so the exit skips the orderly shutdown (`exit_now`): the entries stay pending
and are reclaimed by a live worker or by this one's successor (supervisor restarts it), and
after `max_deliveries` hangs the entry goes to the dead letter. `exit_now` is also how a second
SIGTERM/SIGINT leaves while a forward runs. Never touches Redis, never imports torch.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from vramguard.shared.clock import monotonic_ms
from vramguard.shared.periodic import Periodic

log = logging.getLogger(__name__)

# The derived timeout is this many times the forward time measured at warmup, scaled to a full
# batch, and never under FORWARD_TIMEOUT_MIN_S: a hang detector must not fire on a slow forward.
FORWARD_TIMEOUT_FACTOR = 10.0
FORWARD_TIMEOUT_MIN_S = 10.0
CHECK_INTERVAL_S = 0.2


def derive_forward_timeout_s(
    configured_s: float | None, measured_s: float, measured_items: int, max_batch_size: int
) -> float:
    """The forward timeout: `configured_s` (ModelConfig.forward_timeout_s) when set, else
    FORWARD_TIMEOUT_FACTOR x the warmup forward time (`measured_s` for `measured_items` items)
    scaled linearly to `max_batch_size` items, at least FORWARD_TIMEOUT_MIN_S. Seconds."""
    if configured_s is not None:
        return configured_s
    scale = math.ceil(max_batch_size / max(1, measured_items))
    return max(FORWARD_TIMEOUT_MIN_S, FORWARD_TIMEOUT_FACTOR * measured_s * scale)


def exit_now(code: int, message: str, **fields: object) -> None:
    """Log `message` at ERROR, flush the logs and leave the process with `code` at once: no
    atexit hooks, no join of the thread a forward may be stuck in. Never returns."""
    log.error(message, extra={"exit_code": code, **fields})
    logging.shutdown()
    os._exit(code)


@dataclass(frozen=True, slots=True)
class _Running:
    started_ms: float
    what: str
    request_ids: Sequence[str]


class HangGuard:
    """Watches the forwards of one worker; `on_hang(running_s, what, request_ids)` is called once
    when the oldest runs past `limit_s` (None until warmup has measured it: no limit)."""

    def __init__(self, on_hang: Callable[[float, str, Sequence[str]], None]) -> None:
        self._on_hang = on_hang
        self.limit_s: float | None = None
        self._running: dict[int, _Running] = {}
        self._ids = itertools.count()
        self._fired = False
        self._checker = Periodic("hang-guard", self._check, CHECK_INTERVAL_S)

    def __repr__(self) -> str:
        return f"<HangGuard limit_s={self.limit_s} running={len(self._running)}>"

    @property
    def forward_running(self) -> bool:
        return bool(self._running)

    @contextmanager
    def forward(self, what: str, request_ids: Sequence[str] = ()) -> Iterator[None]:
        """Time the forward run inside the block (`what`: "batch", "probe")."""
        key = next(self._ids)
        self._running[key] = _Running(monotonic_ms(), what, request_ids)
        try:
            yield
        finally:
            self._running.pop(key, None)

    def start(self) -> None:
        self._checker.start()

    async def stop(self) -> None:
        await self._checker.stop()

    async def _check(self) -> None:
        if self.limit_s is None or self._fired or not self._running:
            return
        oldest = min(self._running.values(), key=lambda r: r.started_ms)
        running_s = (monotonic_ms() - oldest.started_ms) / 1000
        if running_s > self.limit_s:
            self._fired = True
            self._on_hang(running_s, oldest.what, oldest.request_ids)
