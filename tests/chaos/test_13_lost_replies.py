"""Scenario 13: Redis replies lost on the way back, so redis-py re-sends commands that already ran.

1. The gateway and two workers (fault injection on, so executions are recorded; max_deliveries
   2) reach Redis through a proxy (tests/proxy.py) that cuts the connection instead of
   delivering every second reply to a script: the admission, the claims, the refreshes, the acks.
2. 20 clients send 120 requests (60 s deadlines); forwards take 200 ms. Once worker 0 holds a
   batch of 4 or more it is SIGKILLed mid-batch and restarted under its name, so its entries are
   claimed again through the proxy.

Result: every request gets 200, exactly once; each ran once, more only when the process that
ran it first was the killed one; no innocent entry reaches the dead letter (a claim re-sent
whole would count its delivery twice: 3 > max_deliveries); the request stream ends empty.
A second variant holds the lost replies past the client's socket timeout instead of cutting, on
the workers' connections only: the workers re-send what timed out (shared/redis_client.py), while a
gateway held past its admission bound answers 503 by design (scenario 17, Redis frozen).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.chaos.conftest import Supervisor
from tests.chaos.load import Load, check_executions, count_reclaimed_requests, held_requests
from tests.helpers import wait_until
from tests.proxy import LossyProxy
from vramguard.shared.keys import GROUP, Keys

REQUESTS = 120


# A held reply (2.5 s, past the 2 s command timeout) also holds the entry it claimed: claim_idle_ms
# must exceed it, or another worker rightly takes the entry over (as in production, 10 s > 2 s).
@pytest.mark.parametrize(("delay_s", "claim_idle_ms"), [(None, 1000), (2.5, 4000)], ids=["cut", "delayed"])
async def test_lost_replies_run_nothing_twice(chaos_stack, chaos_redis, redis_server, delay_s, claim_idle_ms) -> None:
    async with LossyProxy(redis_server.port, delay_s=delay_s) as proxy:
        chaos_stack.settings.update({"fault_injection": "true", "max_deliveries": 2, "claim_idle_ms": claim_idle_ms,
                                     "models__synthetic__max_batch_size": 8,
                                     "models__synthetic__params": '{"batch_ms": 200}'})
        if delay_s is None:  # cut replies: the gateway's admission scripts go through the proxy too
            chaos_stack.redis_url = proxy.url
        chaos_stack.start_gateway()
        chaos_stack.redis_url = proxy.url
        workers = Supervisor(chaos_stack, 2)
        await chaos_stack.wait_ready()
        await workers.wait_live(chaos_stack.url, 2)
        workers.start_watching()
        started = time.monotonic()
        # A deadline of 60 s: every second script reply is lost or held, the workers' acks (a script
        # too) included, and a request may wait through several retries; this scenario is about
        # delivery (once, nothing lost), not latency.
        async with Load(chaos_stack.url, clients=20, timeout_ms=60_000) as load:

            async def kill() -> None:  # once worker 0 holds a batch, so that there is something to claim
                stream = Keys(chaos_stack.settings["key_prefix"]).request_stream("synthetic")

                async def holds_a_batch() -> bool:  # of several requests: each is claimed (or split) on its own
                    return await held_requests(chaos_redis, stream, workers.names[0]) >= 4

                await wait_until(holds_a_batch, 30, interval_s=0.02)
                workers.kill(workers.names[0], signal.SIGKILL)

            await asyncio.gather(load.run_count(REQUESTS), kill())
        wall_s = time.monotonic() - started
        await workers.stop_watching()
        keys = Keys(chaos_stack.settings["key_prefix"])
        repeated = await check_executions(chaos_redis, keys.prefix, load.tally, workers.died)
        reclaimed = count_reclaimed_requests(chaos_stack.log_dir)
        load.tally.report(f"13 lost replies ({'delayed' if delay_s else 'cut'})", wall_s, replies_lost=proxy.lost,
                          ran_twice=repeated, reclaimed=reclaimed)
        load.tally.assert_each_answered_with_its_own()
        assert load.tally.ok == REQUESTS, load.tally.errors
        assert proxy.lost >= 10  # admissions, claims and refreshes all lost replies
        assert [code for _n, code in workers.exits] == [-9]
        assert reclaimed >= max(4, repeated)  # the killed batch was claimed (packs split) and ran again
        assert await chaos_redis.xlen(keys.dead_letter_stream("synthetic")) == 0
        stream = keys.request_stream("synthetic")

        async def drained() -> bool:
            return await chaos_redis.xlen(stream) == 0 and (await chaos_redis.xpending(stream, GROUP))["pending"] == 0

        await wait_until(drained, 10)
