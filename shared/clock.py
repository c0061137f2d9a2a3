"""Clocks: wall-clock epoch milliseconds for deadlines that cross processes, and a
monotonic clock for durations inside one process. Never mix the two."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Wall-clock time as integer epoch milliseconds; what `deadline_ms` and `enqueued_ms` use."""
    return time.time_ns() // 1_000_000


def monotonic_ms() -> float:
    """Monotonic time in milliseconds (float); only differences are meaningful."""
    return time.monotonic_ns() / 1_000_000
