"""Hung forwards and decodes (a stuck kernel, a deadlock in model code, an image decoder that
never returns): `HangGuard` times every forward and every batch's decoding on the monotonic clock
and, when one runs past its own timeout, logs it with the request ids it held and ends the process
at once with ExitCode.FORWARD_HUNG.

Each forward gets a timeout for its own padded cost (items x their largest cost): `ForwardTimeout`
scales the seconds per unit of cost measured at warmup on forwards of full-window items (the
costliest kind: their time includes whatever grows faster than linearly with length) to that
cost. So a reclaimed request of many batches' worth of long inputs, run as many forwards, gets a
timeout per forward that fits each of them, not one sized for the warmup's short examples.

A hung thread cannot be cancelled or joined, and the GPU memory it holds is only freed by the
process exiting, so the exit skips the orderly shutdown (`exit_now`): the entries stay pending
and are reclaimed by a live worker or by this one's successor (supervisor restarts it), and
after `max_deliveries` hangs the entry goes to the dead letter. `exit_now` is also how a second
SIGTERM/SIGINT leaves while a forward runs. Never touches Redis, never imports torch.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from vramguard.shared.clock import monotonic_ms
from vramguard.shared.periodic import Periodic

log = logging.getLogger(__name__)

# A derived timeout is this many times the time measured at warmup, scaled to the forward's cost
# (or the batch's items, for decoding), and never under the floor: a hang detector must not fire
# on a slow forward, nor on a decode slowed by a busy machine.
FORWARD_TIMEOUT_FACTOR = 10.0
FORWARD_TIMEOUT_MIN_S = 10.0
DECODE_TIMEOUT_MIN_S = 30.0
CHECK_INTERVAL_S = 0.2


@dataclass(frozen=True, slots=True)
class ForwardTimeout:
    """The timeouts of one worker's forwards and decodes, seconds.

    `configured_s`: ModelConfig.forward_timeout_s; when set it is every forward's and every
    decode's timeout. Else `seconds_per_cost` (measured: a forward of full-window items, seconds
    over its padded cost) and `decode_s_per_item` (measured: decoding the example inputs, seconds
    per item) are scaled by FORWARD_TIMEOUT_FACTOR to each forward's padded cost and each batch's
    item count, with the floors above."""

    configured_s: float | None
    seconds_per_cost: float
    decode_s_per_item: float

    def for_cost(self, padded_cost: int) -> float:
        """The timeout of a forward of `padded_cost` (items x their largest cost)."""
        if self.configured_s is not None:
            return self.configured_s
        return max(FORWARD_TIMEOUT_MIN_S, FORWARD_TIMEOUT_FACTOR * self.seconds_per_cost * max(1, padded_cost))

    def for_decode(self, n_items: int) -> float:
        """The timeout of decoding and costing a batch's `n_items` inputs."""
        if self.configured_s is not None:
            return self.configured_s
        return max(DECODE_TIMEOUT_MIN_S, FORWARD_TIMEOUT_FACTOR * self.decode_s_per_item * max(1, n_items))


def measure_seconds_per_cost(max_item_cost: int, n_items: int, run_forward: Callable[[int], None]) -> float:
    """Seconds per unit of padded cost of one forward of `n_items` full-window items (each of
    `max_item_cost`): `run_forward(n_items)` runs it. The slower of two runs, so a first-call
    cost left over from the warmup does not make the timeout tight."""
    elapsed: list[float] = []
    for _ in range(2):
        started = monotonic_ms()
        run_forward(n_items)
        elapsed.append((monotonic_ms() - started) / 1000)
    return max(elapsed) / (n_items * max_item_cost)


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
    limit_s: float | None  # None: the guard's limit_s


class HangGuard:
    """Watches the forwards and decodes of one worker; `on_hang(running_s, what, request_ids,
    limit_s)` is called once when one runs past its own limit (none until warmup has measured
    `timeout`). `limit_s`: the limit of a forward given none (the watchdog's probe)."""

    def __init__(self, on_hang: Callable[[float, str, Sequence[str], float], None]) -> None:
        self._on_hang = on_hang
        self.timeout: ForwardTimeout | None = None
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

    def forward_limit_s(self, padded_cost: int) -> float | None:
        """The timeout of a forward of `padded_cost` (None before warmup: no limit)."""
        return self.timeout.for_cost(padded_cost) if self.timeout is not None else None

    def decode_limit_s(self, n_items: int) -> float | None:
        """The timeout of decoding `n_items` inputs (None before warmup: no limit)."""
        return self.timeout.for_decode(n_items) if self.timeout is not None else None

    @contextmanager
    def forward(self, what: str, request_ids: Sequence[str] = (), limit_s: float | None = None) -> Iterator[None]:
        """Time the work inside the block (`what`: "batch", "probe", "decode") against `limit_s`
        (None: the guard's `limit_s`). May be entered from a model thread."""
        key = next(self._ids)
        self._running[key] = _Running(monotonic_ms(), what, request_ids, limit_s)
        try:
            yield
        finally:
            self._running.pop(key, None)

    def start(self) -> None:
        self._checker.start()

    async def stop(self) -> None:
        await self._checker.stop()

    async def _check(self) -> None:
        if self._fired:
            return
        now = monotonic_ms()
        for run in list(self._running.values()):  # a snapshot: model threads add and remove entries
            limit_s = run.limit_s if run.limit_s is not None else self.limit_s
            running_s = (now - run.started_ms) / 1000
            if limit_s is not None and running_s > limit_s:
                self._fired = True
                self._on_hang(running_s, run.what, run.request_ids, limit_s)
                return
