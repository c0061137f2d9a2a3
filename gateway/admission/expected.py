"""Whether a model's workers can be expected back (side path of hop 2, read by admission).

A model with no live worker is not necessarily gone: its workers may be restarting (killed,
unhealthy, hung; supervisor brings them back within seconds). Answering 503 meanwhile would fail
requests that had plenty of deadline left, so admission keeps accepting while a worker of the
model was live within `worker_return_grace_s`: the requests wait in the stream and are served
when a worker returns, or get 504 at their deadline. Two pieces of evidence, both on the shared
clock (shared/clock.py): what this gateway saw at its health refreshes, and the newest score in
the model's worker index in Redis (so a gateway restarted meanwhile knows too). A worker that
exits cleanly removes itself from the index. Never touches Redis itself.
"""

from __future__ import annotations


class ReturnWatch:
    """Per model, the last time (epoch ms, shared clock) a worker was seen live or beating."""

    def __init__(self, grace_s: float) -> None:
        self.grace_ms = int(grace_s * 1000)
        self._last_seen_ms: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<ReturnWatch grace_ms={self.grace_ms} last_seen_ms={self._last_seen_ms}>"

    def saw(self, model: str, at_ms: int | float | None) -> None:
        """Record evidence that a worker of `model` was live at `at_ms` (None: no evidence)."""
        if at_ms is not None and at_ms > self._last_seen_ms.get(model, 0):
            self._last_seen_ms[model] = int(at_ms)

    def expected(self, model: str, now_ms: int) -> bool:
        """True while a worker of `model` was seen within the grace: worth waiting for."""
        last = self._last_seen_ms.get(model)
        return last is not None and now_ms - last <= self.grace_ms

    def last_seen_ms(self, model: str) -> int | None:
        return self._last_seen_ms.get(model)
