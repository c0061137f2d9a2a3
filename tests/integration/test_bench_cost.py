"""The serving-cost measurement (bench/cost.py) against a real gateway and worker: CPU per
request is split by role, adds up to the server total, and a process that is gone counts 0."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from bench.cost import cost_point, process_cpu_s
from tests.helpers import Stack

# The benchmark's own tools, not the service: the slow tier (make test-all).
pytestmark = pytest.mark.slow


async def test_cpu_per_request_by_role_adds_up(stack: Stack) -> None:
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", models__synthetic__params='{"batch_ms": 0, "item_ms": 0}')
    await stack.wait_ready()
    assert stack.gateway is not None
    roles = {"gateway": [stack.gateway.pid], "workers": [w.pid for w in stack.workers]}
    record = await asyncio.to_thread(cost_point, f"{stack.url}/v1/models/synthetic/infer", roles, concurrency=4,
                                     duration_s=1.0, warmup_s=0.3, label="", progress=False)
    per_role = record["cpu_us_per_request"]
    assert isinstance(per_role, dict)
    # 1. Every role spent CPU on the requests; the total is their sum; the client is apart.
    assert set(per_role) == {"gateway", "workers"} and min(per_role.values()) > 0
    assert record["server_cpu_us_per_request"] == pytest.approx(sum(per_role.values()), abs=0.2)
    assert float(record["client_cpu_us_per_request"]) > 0  # type: ignore[arg-type]
    # 2. Divided by every request answered (warm-up included), all of them 200.
    assert record["errors"] == {} and int(record["answered"]) >= int(record["requests"]) > 0  # type: ignore[call-overload]
    # 3. The machine was at least as busy as our processes on it.
    assert float(record["machine_cores_busy"]) >= 0.8 * float(record["cores_busy"]) > 0  # type: ignore[arg-type]


def test_a_process_that_is_gone_counts_zero() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_cpu_s(proc.pid) == 0.0
