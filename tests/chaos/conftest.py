"""Chaos fixtures: a stack of real processes with fast reclaim settings, and a `Supervisor`
that restarts dead workers under the same consumer name, as supervisord's autorestart does."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.helpers import Stack, wait_until

# claim_idle_ms >= 3 x max(reclaim_interval_ms, heartbeat_interval_ms (200)) + max_wait_ms (5)
# fault_injection: the workers record each execution (worker/execlog.py) for check_executions.
CHAOS_SETTINGS: dict[str, object] = {"served_models": "synthetic", "model": "synthetic",
                                     "claim_idle_ms": 1000, "reclaim_interval_ms": 200, "fault_injection": "true"}


class Supervisor:
    """Keeps `n` workers named `chaos-w<i>` running; `exits` records every (name, returncode)."""

    def __init__(self, stack: Stack, n: int, **settings: object) -> None:
        self.stack = stack
        self.settings = settings
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exits: list[tuple[str, int]] = []
        self.died: set[int] = set()  # pids that exited non-zero (their batches may run again)
        self.restart = True
        for i in range(n):
            self._start(f"chaos-w{i}")
        self._task: asyncio.Task[None] | None = None

    def _start(self, name: str) -> None:
        self.procs[name] = self.stack.start_worker(worker_name=name, **self.settings)

    def start_watching(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while self.restart:
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None:
                    self.exits.append((name, proc.returncode))
                    if proc.returncode != 0:
                        self.died.add(proc.pid)
                    self._start(name)
            await asyncio.sleep(0.1)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)

    async def stop_watching(self) -> None:
        self.restart = False
        if self._task is not None:
            await self._task

    async def wait_live(self, url: str, n: int, timeout_s: float = 60) -> None:
        """Until the gateway counts `n` live synthetic workers."""
        async with httpx.AsyncClient(base_url=url) as client:

            async def live() -> bool:
                try:
                    return (await client.get("/v1/models/synthetic")).json()["live_workers"] >= n
                except httpx.HTTPError:
                    return False

            await wait_until(live, timeout_s, interval_s=0.2)


@pytest.fixture
def chaos_stack(stack: Stack) -> Stack:
    stack.settings.update(CHAOS_SETTINGS)
    return stack


@pytest.fixture
async def chaos_redis(chaos_stack: Stack) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(chaos_stack.redis_url)
    yield client
    await client.aclose()
