"""The gateway's long-lived tasks (reply reader, reply-stream keepalive, health refresh, clock sync)
under one watch: each survives any Redis error on its own (it reconnects and reads again); one
that ends anyway, while the gateway is not stopping, leaves the gateway unable to answer, so
readiness fails naming it and the process is asked to exit (gateway/__main__.py) for a restart.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class TaskWatch:
    """Watches named tasks; `ended` names the first one that ended while not `stopping` (else None)."""

    def __init__(self) -> None:
        self.ended: str | None = None
        self.stopping = False

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Mark the gateway broken when `task` ends before `stop()`, whatever the cause."""
        task.add_done_callback(self._done)

    def stop(self) -> None:
        """The gateway is shutting down: tasks ending from now on are expected."""
        self.stopping = True

    def _done(self, task: asyncio.Task[Any]) -> None:
        if self.stopping or self.ended is not None:
            return
        cause = "cancelled" if task.cancelled() else repr(task.exception())
        self.ended = f"background task {task.get_name()} ended ({cause})"
        log.critical("a long-lived task ended; this gateway cannot serve and exits for a restart",
                     extra={"task": task.get_name(), "cause": cause})


async def reconnect(client: Any) -> None:
    """Drop every connection of `client` (a redis-py asyncio Redis or RedisCluster), so the next
    command opens a fresh one: a connection that met an unexpected reply may be out of step, and
    a cluster client re-reads the slot map (its `aclose` makes the next command initialize again);
    under Sentinel the new connection asks the sentinels for the primary. Never raises."""
    try:
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            await pool.disconnect()
        else:
            await client.aclose()
    except Exception as exc:  # closing broken sockets may fail in any way; the next command reconnects anyway
        log.debug("reconnect: closing the old connections failed", extra={"error": repr(exc)})
