"""Test-only record of executions (Settings.fault_injection on the `synthetic` model): before
each forward, one hash field per request, "<request_id> <pid>-<n>", in `<prefix>:exec:<model>`.

Chaos tests read it to prove delivery: every answered request ran at least once, and more than
once only when the process that ran it first died. HSET of a field unique to this forward is
idempotent, so a re-sent command (shared/redis_client.py) cannot make one run look like two.
Off (a no-op) in production. Never imports torch.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import redis.asyncio as aioredis

from vramguard.shared.keys import Keys
from vramguard.shared.settings import Settings


class ExecutionLog:
    """Records which requests each forward of this process runs (only under fault injection)."""

    def __init__(self, settings: Settings) -> None:
        self.enabled = settings.fault_injection and settings.model == "synthetic"
        self._key = Keys(settings.key_prefix).executions(settings.model)
        self._forwards = itertools.count(1)

    async def record(self, redis: aioredis.Redis, request_ids: Sequence[str]) -> None:
        """HSET one field per request id for the forward about to run. Raises RedisError (the
        caller's batch then stays pending, as for any Redis failure before publishing)."""
        if not self.enabled or not request_ids:
            return
        run = f"{os.getpid()}-{next(self._forwards)}"
        await redis.hset(self._key, mapping={f"{rid} {run}": 1 for rid in request_ids})


def read_executions(fields: list[bytes]) -> dict[str, list[int]]:
    """Parse HKEYS of the log: request_id -> the pids that ran it, one per execution."""
    out: dict[str, list[int]] = {}
    for field in fields:
        request_id, run = field.decode().split(" ")
        out.setdefault(request_id, []).append(int(run.split("-")[0]))
    return out
