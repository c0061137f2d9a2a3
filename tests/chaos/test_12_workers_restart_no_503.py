"""Scenario 12: every worker of a model dies at once while requests keep coming.

1. Two workers serve the synthetic model; 20 clients send about 20 requests/s in all, each with a
   25 s deadline, for LOAD_S seconds.
2. At KILL_AT_S both workers get SIGKILL; supervisord (the shipped configuration) restarts them
   under their names RESTART_AFTER_S later (it is held meanwhile, as a real restart that loads a
   large model takes seconds), past the heartbeat TTL: readiness must see the gap.

Result: no request gets 503: the workers were live a moment ago, so the gateway keeps accepting
(readiness meanwhile says "no live worker"), and the restarted workers serve what queued up.
At least 99% get 200, the rest 504 at their deadline, none is lost; every 200 ran at least once,
more only when a killed process ran it first.
A second case: with worker_return_grace_s=1, once the only worker has been gone for longer
than the grace, requests get 503 at once.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.chaos.conftest import Supervisor
from tests.chaos.load import Load, check_executions
from tests.helpers import Stack, wait_until

LOAD_S = 20
KILL_AT_S = 5.0
RESTART_AFTER_S = 4.0  # > heartbeat_ttl_ms (1.5 s in the test settings): no live worker meanwhile
TIMEOUT_MS = 25_000


async def test_killing_every_worker_gives_no_503(chaos_stack: Stack, chaos_redis) -> None:
    chaos_stack.settings.update({"models__synthetic__params": '{"batch_ms": 20}'})
    chaos_stack.start_gateway()
    workers = Supervisor(chaos_stack, 2)
    await chaos_stack.wait_ready()
    await workers.wait_live(chaos_stack.url, 2)
    workers.start_watching()
    not_ready: list[int] = []
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=20, timeout_ms=TIMEOUT_MS) as load, \
            httpx.AsyncClient(base_url=chaos_stack.url) as client:

        async def kill_all() -> None:
            await asyncio.sleep(KILL_AT_S)
            with workers.restarts_held():
                for name in workers.names:
                    workers.kill(name, signal.SIGKILL)
                until = time.monotonic() + RESTART_AFTER_S
                while time.monotonic() < until:  # readiness says so meanwhile
                    not_ready.append((await client.get("/health/ready")).status_code)
                    await asyncio.sleep(0.1)

        paced = load.run_for(LOAD_S, pause_s=lambda r: max(0.0, 1.0 - r.latency_s))
        tally, _ = await asyncio.gather(paced, kill_all())
    wall_s = time.monotonic() - started
    await workers.stop_watching()
    ran_again = await check_executions(chaos_redis, chaos_stack.settings["key_prefix"], tally, workers.died)
    tally.report("12 every worker SIGKILLed under 20 req/s", wall_s, kills=len(workers.exits), ran_again=ran_again,
                 slowest_ms=round(max(r.latency_s for r in tally.results) * 1000),
                 readiness_503_samples=not_ready.count(503))
    assert [code for _n, code in workers.exits] == [-9, -9]
    tally.assert_each_answered_with_its_own()
    assert set(tally.errors) <= {"504 deadline_exceeded"}, tally.errors
    assert tally.ok >= 0.99 * tally.sent, tally.errors
    assert 503 in not_ready  # readiness told the truth: no live worker for a while


async def test_a_model_whose_workers_are_gone_past_the_grace_gets_503(chaos_stack: Stack) -> None:
    chaos_stack.start_gateway(worker_return_grace_s=1)
    worker = chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    async with httpx.AsyncClient(base_url=chaos_stack.url, timeout=10) as client:

        async def refused_at_once() -> bool:
            started = time.monotonic()
            reply = await client.post("/v1/models/synthetic/infer", json={"inputs": [1], "timeout_ms": 3000})
            return reply.status_code == 503 and time.monotonic() - started < 1.0

        await wait_until(refused_at_once, 1 + 2 * 1.5 + 5)  # grace + heartbeat TTL (1.5 s) + slack
