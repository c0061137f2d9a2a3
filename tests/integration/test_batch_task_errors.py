"""An exception inside a worker's batch task (outside the forward: a bug in our own code), with
real gateway and worker processes."""

from __future__ import annotations

import time

import httpx

from tests.helpers import Stack, wait_until


async def test_a_failing_batch_task_answers_500_internal_at_once(stack: Stack) -> None:
    """1. One synthetic worker (fault injection on; claim_idle_ms 10 s, the default) gets a
       request whose costing raises ({"fault": "internal"}).
    Result: the caller gets 500 `internal` well before any reclaim could happen; the worker logs
    "batch task failed" with the request id, counts it in
    vramguard_worker_batch_task_failures_total, and serves the next request."""
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", fault_injection="true")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        started = time.monotonic()
        reply = await client.post("/v1/models/synthetic/infer", json={"inputs": [{"fault": "internal"}]})
        elapsed_s = time.monotonic() - started
        body = reply.json()["error"]
        assert (reply.status_code, body["code"]) == (500, "internal"), body
        assert elapsed_s < 5.0  # claim_idle_ms is 10 s: answered by the worker, not by a reclaim
        assert (await client.post("/v1/models/synthetic/infer", json={"inputs": [1]})).status_code == 200

        async def counted() -> bool:
            text = (await client.get("/metrics")).text
            return any(line.startswith("vramguard_worker_batch_task_failures_total{") and line.endswith(" 1.0")
                       for line in text.splitlines())

        await wait_until(counted, 10)
    log = (stack.log_dir / "worker-0.log").read_text()
    failed = [line for line in log.splitlines() if '"batch task failed"' in line]
    assert len(failed) == 1 and body["request_id"] in failed[0]
