"""Long-lived background tasks, gateway's and worker's alike: one watch over them, and the
reconnect a task does after Redis answered in a way it did not expect.

Each long-lived task (the gateway's reply reader, keepalive, health refresh and clock sync; the
worker's heartbeat, reclaim scan, clock sync and hang guard) survives any Redis error on its own.
One that ends anyway, while its process is not stopping, leaves a process that cannot do its job:
`TaskWatch` records why and calls the owner's `on_end`, which fails readiness and asks the process
to exit so that its supervisor restarts it. Never imports torch or FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


class TaskWatch:
    """Watches tasks; `ended` says which one ended first while not `stopping` (else None), and
    `on_end(reason)` is called once then."""

    def __init__(self, on_end: Callable[[str], None] = lambda reason: None) -> None:
        self._on_end = on_end
        self.stopping = False
        self.ended: str | None = None
        self.watched: list[str] = []

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Report `task` when it ends before `stop()`, whatever the cause."""
        task.add_done_callback(self._done)
        self.watched.append(task.get_name())

    def watch_running(self, names: Iterable[str]) -> None:
        """Watch this event loop's running tasks named `names` (call after starting them): found by
        name, so a task is watched whichever class runs it."""
        wanted = set(names)
        for task in asyncio.all_tasks():
            if task.get_name() in wanted and not task.done():
                self.watch(task)

    def stop(self) -> None:
        """The process is stopping its tasks: their ends are expected from now on."""
        self.stopping = True

    def _done(self, task: asyncio.Task[Any]) -> None:
        if self.stopping or self.ended is not None:
            return
        cause = "cancelled" if task.cancelled() else repr(task.exception())
        self.ended = f"long-lived task {task.get_name()} ended ({cause})"
        self._on_end(self.ended)


async def reconnect(client: Any) -> None:
    """Drop every connection of `client` (a redis-py asyncio Redis or RedisCluster) so the next
    command opens a fresh one: a connection that met a reply of a shape the command does not take
    may be out of step with Redis. A cluster client re-reads the slot map on its next command after
    `aclose`; under Sentinel a new connection asks the sentinels for the primary. Never raises."""
    try:
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            await pool.disconnect()
        else:
            await client.aclose()
    except Exception as exc:  # noqa: BLE001 - closing broken sockets may fail in any way; the next command reconnects
        log.debug("reconnect: closing the old connections failed", extra={"error": repr(exc)})
