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
from collections.abc import Awaitable, Callable
from typing import Any

from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

from vramguard.shared.tasks import reconnect

log = logging.getLogger(__name__)

# The asyncio task names of the long-lived tasks (shared/periodic.py and shared/clocksync.py name
# their tasks): looked up by name, so a task is watched whichever class runs it.
LONG_LIVED = ("heartbeat", "alive-file", "reclaim", "clock-sync", "hang-guard")


# Consecutive failures of the batch loop's Redis calls that were not RedisErrors (a reply of a
# shape redis-py could not parse, each followed by a reconnect) after which the worker gives up
# and exits for a restart: a Redis that only ever answers so is not one this process can fix.
MAX_UNEXPECTED_FAILURES = 10


class LoopRecovery:
    """What the batch loop does after its Redis call raised: back off (jittered, exponential, as
    long as Redis errors last: Redis down is waited out), reconnect the client after an error
    redis-py did not classify, and after MAX_UNEXPECTED_FAILURES of those in a row say to stop."""

    def __init__(self, pause: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """`pause`: how the back-off is waited (PrimaryWatch.pause ends it at a failover)."""
        self._backoff = ExponentialWithJitterBackoff(base=0.05, cap=2.0)
        self._pause = pause
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
        await self._pause(self._backoff.compute(self.failures))
        return True
