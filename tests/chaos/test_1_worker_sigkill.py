"""Scenario 1: workers SIGKILLed under load.

1. Three workers serve the synthetic model (batches of up to 16 items).
2. 50 concurrent clients send requests for 30 s.
   Forwards of 100 ms keep every worker busy, so batches fill up and a kill hits a full one.
3. Every 5 s a random worker gets SIGKILL, mid-batch; the test restarts it under the same
   consumer name (as supervisord does).

Result: every request gets exactly one answer, its own (lost 0, foreign 0), at least 99% are
200; each ran at least once, and more than once only when a killed process ran it first (how
many is printed); the batch each killed worker held is reclaimed (XAUTOCLAIM after
claim_idle_ms, or replayed by its successor): at least one reclaimed request per kill, at least
one per re-run request (an entry that carried several requests counts each); the request stream
is empty at the end.
"""

from __future__ import annotations

import asyncio
import random
import time

from tests.chaos.conftest import Supervisor
from tests.chaos.load import Load, check_executions, count_reclaimed_requests
from tests.helpers import wait_until
from vramguard.shared.keys import GROUP, Keys

LOAD_S = 30
KILL_EVERY_S = 5


async def test_sigkill_a_random_worker_every_5_s(chaos_stack, chaos_redis) -> None:
    chaos_stack.settings.update({"models__synthetic__max_batch_size": 16,
                                 "models__synthetic__params": '{"batch_ms": 100, "item_ms": 0.5}'})
    chaos_stack.start_gateway()
    workers = Supervisor(chaos_stack, 3)
    await chaos_stack.wait_ready()
    await workers.wait_live(chaos_stack.url, 3)
    workers.start_watching()
    rng = random.Random(4)
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=50) as load:

        async def killer() -> None:
            for _ in range(LOAD_S // KILL_EVERY_S - 1):
                await asyncio.sleep(KILL_EVERY_S)
                workers.kill(rng.choice(workers.names))

        tally, _ = await asyncio.gather(load.run_for(LOAD_S), killer())
    wall_s = time.monotonic() - started
    await workers.stop_watching()
    reclaimed = count_reclaimed_requests(chaos_stack.log_dir)
    ran_again = await check_executions(chaos_redis, chaos_stack.settings["key_prefix"], tally, workers.died)
    tally.report("1 worker SIGKILL every 5 s", wall_s, kills=len(workers.exits), reclaimed=reclaimed,
                 ran_again=ran_again)
    kills = [code for _name, code in workers.exits]
    assert reclaimed >= max(len(kills), ran_again), (reclaimed, ran_again)
    assert len(kills) >= LOAD_S // KILL_EVERY_S - 1 and all(code == -9 for code in kills), kills
    tally.assert_each_answered_with_its_own()
    assert tally.ok >= 0.99 * tally.sent, tally.errors
    stream = Keys(chaos_stack.settings["key_prefix"]).request_stream("synthetic")

    async def drained() -> bool:
        return await chaos_redis.xlen(stream) == 0 and (await chaos_redis.xpending(stream, GROUP))["pending"] == 0

    await wait_until(drained, 10)
