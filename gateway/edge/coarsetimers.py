"""Coarse timers: callbacks due at a loop time, fired by one repeating timer per owner instead of
one timer each. For deadlines that are per request or per connection and need no precision (the
HTTP guard's header and body deadlines, the start of a disconnect watch): on uvloop a timer's
call_later and its cancel cost 2.6-4.8 us with hundreds pending, as under load, and a request
armed three of them; here arming and cancelling are a dict write and a dict pop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable


class CoarseTimers:
    """Callbacks by key, each run once, up to `resolution_s` after the loop time it is due at,
    unless cancelled first. Every `resolution_s` while any is pending, one timer runs those due."""

    def __init__(self, loop: asyncio.AbstractEventLoop, resolution_s: float) -> None:
        self.loop = loop
        self.resolution_s = resolution_s
        self._due: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._due

    def call_later(self, key: Hashable, delay_s: float, callback: Callable[[], None]) -> None:
        """Run `callback` `delay_s` from now (to within the resolution), replacing what `key` had."""
        self._due[key] = (self.loop.time() + delay_s, callback)
        if self._timer is None:
            self._timer = self.loop.call_later(self.resolution_s, self._run_due)

    def cancel(self, key: Hashable) -> None:
        """Forget `key`'s callback, if it has one that has not run."""
        self._due.pop(key, None)

    def _run_due(self) -> None:
        self._timer = None
        now = self.loop.time()
        due = [(key, callback) for key, (when, callback) in self._due.items() if when <= now]
        for key, callback in due:
            if self._due.pop(key, None) is not None:  # an earlier callback may have cancelled it
                callback()
        if self._due:
            self._timer = self.loop.call_later(self.resolution_s, self._run_due)
