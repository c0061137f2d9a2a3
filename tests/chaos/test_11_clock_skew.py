"""Scenario 11: workers whose clocks disagree with the gateway's.

1. A gateway on the host's clock, and two workers started under libfaketime (Debian's
   `faketime`): one 10 s ahead, one 10 s behind.
2. 10 clients send requests with 3 s deadlines for LOAD_S seconds while the test reads
   /health/ready every 100 ms.

Result: no 504 (the worker ahead does not take live requests for expired ones), every request
gets 200 and runs once, both workers serve some of them (the one behind does not look dead),
and readiness stays 200 with both workers live throughout: deadlines and heartbeat ages are
compared on one clock, Redis' (shared/clock.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import psutil

from tests.chaos.load import Load, check_executions, record_figures
from tests.ci import require_part
from tests.helpers import ROOT, Stack, service_env, wait_until
from vramguard.shared.keys import Keys
from vramguard.worker.batch.execlog import read_executions

LOAD_S = 8
SKEWS = ("+10s", "-10s")


async def test_workers_10_s_ahead_and_behind_serve_without_504(chaos_stack: Stack, chaos_redis) -> None:
    faketime = shutil.which("faketime")
    require_part(faketime, "no faketime binary (apt-get install -y faketime; .ci/run does)")
    chaos_stack.settings.update({"models__synthetic__params": '{"batch_ms": 20}'})
    chaos_stack.start_gateway()
    procs = []
    try:
        for i, skew in enumerate(SKEWS):
            # libfaketime shifts the monotonic clock too (harmless: only differences count);
            # FAKETIME_DONT_FAKE_MONOTONIC=1 would make Python's time.sleep fail with EINVAL.
            env = service_env(chaos_stack.redis_url, **chaos_stack.settings, worker_name=f"skew-{i}")
            log = open(chaos_stack.log_dir / f"skew-{i}.log", "ab")  # noqa: SIM115 - closed below
            argv = [faketime, "-f", skew, sys.executable, "-m", "vramguard.worker"]
            # faketime forks the worker and waits for it: a session of their own lets the cleanup
            # signal both (terminating faketime alone would leave the worker running).
            procs.append((subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        async with httpx.AsyncClient(base_url=chaos_stack.url, timeout=10) as client:

            async def both_live() -> bool:
                try:
                    return (await client.get("/v1/models/synthetic")).json()["live_workers"] == 2
                except httpx.HTTPError:
                    return False

            await wait_until(both_live, 60, interval_s=0.2)
            readiness: list[tuple[int, int]] = []

            async def watch(until: float) -> None:
                while time.monotonic() < until:
                    ready = await client.get("/health/ready")
                    live = ready.json()["models"]["synthetic"]["live_workers"]
                    readiness.append((ready.status_code, live))
                    await asyncio.sleep(0.1)

            started = time.monotonic()
            async with Load(chaos_stack.url, clients=10, timeout_ms=3000) as load:
                await asyncio.gather(load.run_for(LOAD_S), watch(started + LOAD_S))
        tally = load.tally
        keys = Keys(chaos_stack.settings["key_prefix"])
        runs = read_executions(await chaos_redis.hkeys(keys.executions("synthetic")))
        pids = {pid for pid_list in runs.values() for pid in pid_list}
        tally.report("11 workers 10 s ahead and behind", time.monotonic() - started,
                     readiness_not_200=sum(1 for s, _ in readiness if s != 200),
                     min_live=min(live for _, live in readiness), worker_pids_serving=len(pids))
        tally.assert_each_answered_with_its_own()
        assert tally.ok == tally.sent, tally.errors
        assert await check_executions(chaos_redis, chaos_stack.settings["key_prefix"], tally, set()) == 0
        assert len(pids) == len(SKEWS), "both skewed workers served requests"  # (faketime forks: other pids)
        assert readiness and all(entry == (200, 2) for entry in readiness), sorted(set(readiness))
    finally:
        for proc, log in procs:
            with contextlib.suppress(ProcessLookupError):  # the whole session has already exited
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
            log.close()
        for proc, _log in procs:  # the workers themselves are gone too, not only faketime
            assert not session_members(proc.pid), f"processes of session {proc.pid} still running"
    record_figures(f"[chaos] 11 clock skew {SKEWS}: readiness samples={len(readiness)}")


def session_members(session: int, wait_s: float = 20.0) -> list[int]:
    """Pids still in `session` after up to `wait_s` (a draining worker takes a moment to exit)."""
    deadline = time.monotonic() + wait_s
    while True:
        members = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                    members.append(proc.pid)
            except (OSError, psutil.Error):
                continue  # exited while we looked
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)
