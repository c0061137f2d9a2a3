"""`python -m vramguard.worker.alive`, the worker's exec liveness probe on Kubernetes: alive while its own
heartbeat is fresh, dead when it has none, and no verdict (alive) when Redis cannot be asked."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, service_env
from vramguard.worker.alive import check


async def test_alive_follows_the_workers_own_heartbeat(start_worker, settings_factory) -> None:
    await start_worker(worker_name="probe-me")
    alive, why = await check(settings_factory(worker_name="probe-me"))
    assert alive, why
    alive, why = await check(settings_factory(worker_name="never-started"))
    assert not alive and "no heartbeat" in why
    alive, why = await check(settings_factory(worker_name="probe-me", redis_url="redis://127.0.0.1:1/0"))
    assert alive and "unreachable" in why


def test_alive_as_a_command_exits_1_without_a_heartbeat(fast_settings) -> None:
    env = service_env(str(fast_settings["redis_url"]), key_prefix=fast_settings["key_prefix"],
                      worker_name="ghost")
    done = subprocess.run([sys.executable, "-m", "vramguard.worker.alive"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "no heartbeat for worker 'ghost'" in done.stdout
