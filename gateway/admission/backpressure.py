"""Side path of hop 2: how long a client refused with 429 `queue_full` should wait.

`ThroughputMeter` counts the replies this gateway received for a model over a sliding window;
`retry_after_s` turns the queue depth and that rate into a Retry-After in whole seconds: the
time the workers need to serve what is queued now, so it grows with the backlog, and with a
stalled worker (its replies age out of the window and the rate falls: no reply over a span is a
rate under one per span), and clients refused at different depths come back at different times
instead of in lock-step. The rate is this gateway's view; with several
gateways behind a load balancer each sees its share of replies and of the refused clients, so the
estimate stays of the right order. Never touches Redis.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 10.0  # replies older than this no longer count toward the rate
MIN_SPAN_S = 1.0  # shortest span of replies a rate is computed from
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class ThroughputMeter:
    """Replies per second over the last `window_s` seconds (monotonic clock, injectable for tests)."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()
        # The start of the current busy spell: the first demand after a window without replies or
        # demand. Before it the gateway was idle, and no reply then says nothing about the workers.
        self._busy_since = clock()
        self._last_demand = -float("inf")

    def record(self, n: int = 1) -> None:
        """Count `n` replies received now."""
        now = self._clock()
        self._times.extend([now] * n)
        self._expire(now)

    def note_demand(self, waiting: int = 0) -> None:
        """A request asks to be queued now (admitted or refused); `waiting`: how many requests this
        gateway admitted earlier still wait for their reply. A window without demand and without
        replies starts a new busy spell only when none wait: requests waiting through a silent window
        are a stalled worker's, and its rate (under one reply per window) is what Retry-After needs."""
        now = self._clock()
        replied = bool(self._times) and self._times[-1] >= now - self._window_s
        if now - self._last_demand > self._window_s and not replied and not waiting:
            self._busy_since = now
        self._last_demand = now

    def rate_per_s(self) -> float | None:
        """Replies per second over the span watched: the window, or the busy spell when that is
        shorter; None while that span is under MIN_SPAN_S (too short to tell). No reply in
        the span is a rate under one per span, and counts as that bound: a stalled worker's rate
        keeps falling as its replies age out, until one per window."""
        now = self._clock()
        self._expire(now)
        span_s = min(self._window_s, now - self._busy_since)
        if span_s < MIN_SPAN_S:
            return None
        return max(len(self._times), 1) / span_s

    def _expire(self, now: float) -> None:
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()


def retry_after_s(depth: int, rate_per_s: float | None) -> int:
    """Seconds until the `depth` requests queued or in flight are served at `rate_per_s`
    (ThroughputMeter), rounded up and clamped to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]; the
    minimum while the rate is unknown (None: a gateway started under a second ago)."""
    if not rate_per_s:
        return MIN_RETRY_AFTER_S
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(depth / rate_per_s)))
