"""The worker's long-lived tasks (heartbeat, reclaim scan, clock sync, hang guard) under one
watch, and what the batch loop does after a Redis call failed in a way redis-py did not classify.

Each long-lived task survives any error on its own (shared/periodic.py logs it and calls again on
the next round; redis-py reconnects on the next command). One that ends anyway, while the worker
is not stopping, leaves a worker that no longer beats, reclaims or keeps its clock: `TaskWatch`
then asks the worker to exit (runner.py, ExitCode.TASK_ENDED) so that its supervisor restarts it.
Never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# The asyncio task names of the long-lived tasks (shared/periodic.py and shared/clocksync.py name
# their tasks): looked up by name, so a task is watched whichever class runs it.
LONG_LIVED = ("heartbeat", "reclaim", "clock-sync", "hang-guard")


class TaskWatch:
    """Calls `on_end(reason)` once when a watched task ends before `stop()`, whatever the cause."""

    def __init__(self, on_end: Callable[[str], None]) -> None:
        self._on_end = on_end
        self.stopping = False
        self.ended: str | None = None
        self.watched: list[str] = []

    def watch_running(self, names: Iterable[str] = LONG_LIVED) -> None:
        """Watch this event loop's running tasks named `names` (call after starting them)."""
        wanted = set(names)
        for task in asyncio.all_tasks():
            if task.get_name() in wanted and not task.done():
                task.add_done_callback(self._done)
                self.watched.append(task.get_name())

    def stop(self) -> None:
        """The worker is stopping its tasks: their ends are expected from now on."""
        self.stopping = True

    def _done(self, task: asyncio.Task[Any]) -> None:
        if self.stopping or self.ended is not None:
            return
        cause = "cancelled" if task.cancelled() else repr(task.exception())
        self.ended = f"long-lived task {task.get_name()} ended ({cause})"
        self._on_end(self.ended)  # which logs it


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


# Consecutive failures of the batch loop's Redis calls that were not RedisErrors (a reply of a
# shape redis-py could not parse, each followed by a reconnect) after which the worker gives up
# and exits for a restart: a Redis that only ever answers so is not one this process can fix.
MAX_UNEXPECTED_FAILURES = 10


class LoopRecovery:
    """What the batch loop does after its Redis call raised: back off (jittered, exponential, as
    long as Redis errors last: Redis down is waited out), reconnect the client after an error
    redis-py did not classify, and after MAX_UNEXPECTED_FAILURES of those in a row say to stop."""

    def __init__(self) -> None:
        self._backoff = ExponentialWithJitterBackoff(base=0.05, cap=2.0)
        self.failures = 0
        self.unexpected = 0

    def succeeded(self) -> None:
        self.failures = self.unexpected = 0

    async def failed(self, what: str, exc: Exception, client: Any) -> bool:
        """Log `exc` (raised by the call `what` made on `client`), reconnect if redis-py did not
        classify it, wait the back-off; False when the loop should give up (the worker exits)."""
        self.failures += 1
        expected = isinstance(exc, RedisError)
        self.unexpected = 0 if expected else self.unexpected + 1
        log.warning("a Redis call of the batch loop failed", extra={"call": what, "error": repr(exc),
                                                                    "failures": self.failures})
        if not expected:
            await reconnect(client)
            if self.unexpected >= MAX_UNEXPECTED_FAILURES:
                return False
        await asyncio.sleep(self._backoff.compute(self.failures))
        return True
