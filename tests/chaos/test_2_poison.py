"""Scenario 2: a poison input that kills whichever worker runs it.

1. Three workers (fault injection on, max_deliveries=3) serve normal traffic from 20 clients.
   claim_idle_ms is 3 s here, about a worker's restart time, so that deaths are spaced and some
   worker is always live (with every worker dead the gateway rightly answers 503).
2. One request carries {"fault": "exit"}: the forward that runs it calls os._exit(137).
3. The test restarts every worker that dies, under the same consumer name.

Result: the poison kills its batch's worker, then (run alone after each reclaim) one worker per
delivery, max_deliveries deaths in all; its next claim moves it to the dead-letter stream and its
client gets 500 model_error naming the dead letter. Every other request gets 200 (each ran at
least once, more only when a dying process ran it first), and no worker dies after that.
"""

from __future__ import annotations

import asyncio
import time

from tests.chaos.conftest import Supervisor
from tests.chaos.load import Load, check_executions, count_logged
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import ENTRY_FIELD, RequestMessage

MAX_DELIVERIES = 3


async def test_poison_input_ends_in_the_dead_letter(chaos_stack, chaos_redis) -> None:
    chaos_stack.settings.update({"fault_injection": "true", "max_deliveries": MAX_DELIVERIES, "claim_idle_ms": 3000,
                                 "models__synthetic__max_batch_size": 16,
                                 "models__synthetic__params": '{"batch_ms": 50}'})
    chaos_stack.start_gateway()
    workers = Supervisor(chaos_stack, 3)
    await chaos_stack.wait_ready()
    await workers.wait_live(chaos_stack.url, 3)
    workers.start_watching()
    started = time.monotonic()
    async with Load(chaos_stack.url, clients=20) as load:

        async def poison() -> None:
            await asyncio.sleep(1.0)
            result = await load.request({"fault": "exit"})
            deaths_at_answer.append(len(workers.exits))
            poison_results.append(result)

        deaths_at_answer: list[int] = []
        poison_results = []
        await asyncio.gather(load.run_for(16), poison())
    wall_s = time.monotonic() - started
    await asyncio.sleep(1.0)  # would a worker die again?
    await workers.stop_watching()
    tally = load.tally
    dead_lettered = count_logged(chaos_stack.log_dir, "entry dead-lettered")
    ran_again = await check_executions(chaos_redis, chaos_stack.settings["key_prefix"], tally, workers.died)
    tally.report("2 poison input", wall_s, worker_deaths=len(workers.exits), dead_lettered=dead_lettered,
                 ran_again=ran_again)
    assert dead_lettered == 1
    tally.assert_each_answered_with_its_own()
    (poisoned,) = poison_results
    assert poisoned.status == 500 and poisoned.code == "model_error", poisoned
    assert tally.ok == tally.sent - 1, tally.errors  # every other request succeeded
    assert [code for _name, code in workers.exits] == [137] * MAX_DELIVERIES
    assert deaths_at_answer == [MAX_DELIVERIES]  # and none after its client got the error
    dead = await chaos_redis.xrange(Keys(chaos_stack.settings["key_prefix"]).dead_letter_stream("synthetic"))
    assert [RequestMessage.decode(fields[ENTRY_FIELD]).inputs for _id, fields in dead] == [[{"fault": "exit"}]]
    assert b"max_deliveries=3" in dead[0][1][b"reason"]
