"""`Periodic`: run an async callable every interval until stopped, without ever cancelling it
mid-call. redis-py's asyncio client can hang or leave a stale reply on a connection whose
command was cancelled, so the heartbeat, the health refresh and the reply-stream keepalive
stop between calls instead."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Periodic:
    """Calls `fn` at once, then every `interval_s`, in a task named `name`.

    `fn` must handle its own expected errors; an unexpected one is logged and the loop goes on.
    """

    def __init__(self, name: str, fn: Callable[[], Awaitable[None]], interval_s: float) -> None:
        self.name = name
        self._fn = fn
        self._interval_s = interval_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The running loop's task (None before `start`), for a watcher of long-lived tasks."""
        return self._task

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self._fn()
            except Exception:
                log.exception("periodic task failed", extra={"task": self.name})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._interval_s)

    async def stop(self) -> None:
        """Let the current call finish, then stop."""
        self._stop.set()
        if self._task is not None:
            await self._task
