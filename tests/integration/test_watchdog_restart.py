"""A failing probe leads to an exit and a restart, with real processes: a real supervisord runs
`python -m vramguard.worker` with the shipped deploy/supervisord.conf, and a real gateway process watches."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack, SupervisedWorker, service_env, wait_until


@pytest.mark.slow
async def test_a_failing_probe_exits_and_supervisor_restarts_the_worker(stack: Stack, tmp_path: Path) -> None:
    """1. supervisord starts a synthetic worker whose idle probe hits a CUDA error (fault injection).
    2. The probe fails: the worker exits with ExitCode.UNHEALTHY (6).
    3. supervisord sees an unexpected exit and starts a fresh process under the same name.
    Result: the gateway sees the worker with a new pid and start time; readiness went 503 between."""
    stack.start_gateway(served_models="synthetic")
    env = service_env(stack.redis_url, **{**stack.settings, "model": "synthetic",
                                          "fault_injection": "true", "probe_fault": "cuda_error",
                                          "probe_interval_s": 2})
    supervised = SupervisedWorker(tmp_path, env)
    supervised.start()
    try:
        await stack.wait_ready(timeout_s=60)
        lives: set[float] = set()  # started_ms of each ready incarnation of the worker seen
        readiness: set[int] = set()
        async with httpx.AsyncClient(base_url=stack.url) as client:

            async def restarted() -> bool:
                readiness.add((await client.get("/health/ready")).status_code)
                for w in (await client.get("/status.json")).json()["models"][0]["workers"]:
                    if w["worker_id"] == supervised.worker_name and w["state"] == "ready":
                        lives.add(w["started_ms"])
                return len(lives) >= 2

            await wait_until(restarted, 90, interval_s=0.1)
        assert 503 in readiness and 200 in readiness
        log = (tmp_path / "supervisord.log").read_text()
        assert f"exited: {supervised.process} (exit status 6; not expected)" in log, log
        assert '"probe failed"' in supervised.worker_log.read_text()
    finally:
        supervised.stop()
