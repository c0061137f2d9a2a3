"""Side path of hop 2: how long a client refused with 429 `queue_full` should wait.

`ThroughputMeter` counts the replies this gateway received for a model over a sliding window;
`retry_after_s` turns the queue depth and that rate into a Retry-After in whole seconds: the
time the workers need to serve what is queued now. The rate is this gateway's view; with several
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

    def record(self, n: int = 1) -> None:
        """Count `n` replies received now."""
        now = self._clock()
        self._times.extend([now] * n)
        self._expire(now)

    def rate_per_s(self) -> float | None:
        """Replies per second from the oldest reply in the window until now; None while that
        span is under MIN_SPAN_S (a first batch of replies says little about the rate) or the
        window holds no reply (an idle gateway and stuck workers look alike from here)."""
        now = self._clock()
        self._expire(now)
        if not self._times or now - self._times[0] < MIN_SPAN_S:
            return None
        return len(self._times) / (now - self._times[0])

    def _expire(self, now: float) -> None:
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()


def retry_after_s(depth: int, rate_per_s: float | None) -> int:
    """Seconds until the `depth` entries queued or in flight are served at `rate_per_s`, rounded
    up and clamped to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]; the minimum while the rate is
    unknown (None)."""
    if not rate_per_s:
        return MIN_RETRY_AFTER_S
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(depth / rate_per_s)))
