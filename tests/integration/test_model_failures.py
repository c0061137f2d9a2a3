"""A model that raises on one input fails that request alone; the rest of its batch succeeds
and the worker keeps serving."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.helpers import wait_until


async def test_one_failing_input_fails_only_its_request(gateway, start_worker,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="vramguard.worker.batch.serve")
    handle = await start_worker(model="synthetic", fault_injection=True,
                                models={"synthetic": {"max_wait_ms": 200, "params": {"batch_ms": 50}}})

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    warm = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [0, 0]})  # opens the batch window
    assert warm.status_code == 200
    bodies = [{"inputs": [i]} for i in range(7)] + [{"inputs": [{"fault": "raise"}]}]
    responses = await asyncio.gather(*(gateway.post("/v1/models/synthetic/infer", json=b) for b in bodies))
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * 7 + [500], statuses
    assert responses[-1].json()["error"]["code"] == "model_error"
    assert "injected fault" in responses[-1].json()["error"]["message"]
    # The worker's log names the failed request, so the 500 can be matched to the model's error.
    failed_id = responses[-1].json()["error"]["request_id"]
    logged = [r for r in caplog.records if r.getMessage() == "request failed"]
    assert [(r.request_id, r.code) for r in logged] == [(failed_id, "model_error")]  # type: ignore[attr-defined]
    assert "injected fault" in logged[0].error  # type: ignore[attr-defined]
    assert [r.json()["outputs"] for r in responses[:7]] == [[i] for i in range(7)]
    assert handle.worker.stats.max_batch_seen == 8  # they really shared one batch
    again = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [42]})
    assert again.status_code == 200 and again.json()["outputs"] == [42]
