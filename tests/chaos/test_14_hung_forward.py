"""Scenario 14: a forward that never returns, and signals while one runs.

A. 1. A real supervisord, with the shipped deploy/supervisord.conf, runs one synthetic worker
      (fault injection on, forward timeout 2 s, max_deliveries 2); five normal requests and one
      {"fault": "hang"} are sent together.
   2. The hanging forward passes its timeout: the worker logs "forward hung" with the request
      ids it held and exits 8 (ExitCode.FORWARD_HUNG); supervisord restarts it under its name;
      the restarted worker takes its pending entries back, each run alone.
   Result: the hang input hangs each delivery (two exits 8), then its next claim moves it to
   the dead letter and its client gets 500 model_error; the five others get 200, each executed
   at most twice (once more only if the killed process ran it first).
B. A worker whose forward hangs (no timeout in sight) gets SIGTERM, then a second SIGTERM.
   Result: the first starts a drain that cannot finish; the second ends the process at once with
   exit code 4 (ExitCode.FORCED), leaving the entry pending for reclaim.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

from tests.chaos.load import Load, record_figures
from tests.helpers import Stack, SupervisedWorker, service_env, wait_until
from vramguard.shared.keys import Keys
from vramguard.worker.batch.execlog import read_executions


async def test_a_hung_forward_exits_8_and_ends_in_the_dead_letter(chaos_stack: Stack, chaos_redis,
                                                                   tmp_path: Path) -> None:
    chaos_stack.settings.update({"fault_injection": "true", "max_deliveries": 2, "claim_idle_ms": 1000,
                                 "models__synthetic__forward_timeout_s": 2,
                                 "models__synthetic__params": '{"batch_ms": 50}'})
    chaos_stack.start_gateway()
    folder = tmp_path / "sup"
    folder.mkdir()
    supervised = SupervisedWorker(folder, service_env(chaos_stack.redis_url, **chaos_stack.settings))
    supervised.start()
    try:
        await chaos_stack.wait_ready(timeout_s=60)
        started = time.monotonic()
        async with Load(chaos_stack.url, clients=6, timeout_ms=60_000) as load:
            hung, *normal = await asyncio.gather(load.request({"fault": "hang"}), *(load.request() for _ in range(5)))
        wall_s = time.monotonic() - started
        sup_log = (folder / "supervisord.log").read_text()
        exits = re.findall(rf"exited: {re.escape(supervised.process)} \(exit status (\d+)", sup_log)
        keys = Keys(chaos_stack.settings["key_prefix"])
        runs = read_executions(await chaos_redis.hkeys(keys.executions("synthetic")))
        record_figures(f"[chaos] 14A hung forward: wall_s={wall_s:.1f} exits={exits} hung={hung.status} "
                       f"normal={[r.status for r in normal]} executions={sorted(len(p) for p in runs.values())}")
        assert (hung.status, hung.code) == (500, "model_error") and "dead-letter" in (hung.message or ""), hung
        assert [r.status for r in normal] == [200] * 5
        assert exits == ["8", "8"], sup_log
        assert supervised.worker_log.read_text().count('"forward hung; exiting for a restart"') == 2
        assert await chaos_redis.xlen(keys.dead_letter_stream("synthetic")) == 1
        assert all(len(runs[r.request_id]) <= 2 for r in normal), runs
    finally:
        supervised.stop()


async def test_a_second_sigterm_exits_at_once_during_a_hung_forward(chaos_stack: Stack, chaos_redis) -> None:
    chaos_stack.settings.update({"fault_injection": "true", "shutdown_grace_s": 60})
    chaos_stack.start_gateway()
    worker = chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    async with Load(chaos_stack.url, clients=1, timeout_ms=3000) as load:
        request = asyncio.ensure_future(load.request({"fault": "hang"}))
        executions = Keys(chaos_stack.settings["key_prefix"]).executions("synthetic")

        async def forward_started() -> bool:
            return await chaos_redis.hlen(executions) == 1

        await wait_until(forward_started, 10)
        await asyncio.sleep(0.2)  # into the forward, which hangs
        worker.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert worker.poll() is None  # draining: waits for the forward
        worker.send_signal(signal.SIGTERM)
        second_s = time.monotonic()
        code = await asyncio.to_thread(worker.wait, 10)
        exited_after_s = time.monotonic() - second_s
        await request
    record_figures(f"[chaos] 14B second SIGTERM mid-forward: exit_code={code} exited_after_s={exited_after_s:.2f}")
    assert code == 4 and exited_after_s < 2.0
