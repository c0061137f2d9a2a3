"""Readiness that tells the truth, and the worker's watchdog, with a real Redis, an
in-process gateway and in-process workers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from tests.helpers import wait_until
from vramguard.gateway.app import create_app
from vramguard.shared.settings import Settings
from vramguard.worker.runner import ExitCode


@asynccontextmanager
async def synthetic_gateway(settings_factory: Callable[..., Settings]) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process gateway that serves only `synthetic`."""
    app = create_app(settings_factory(served_models="synthetic"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            yield client


async def status(client: httpx.AsyncClient, path: str) -> int:
    return (await client.get(path)).status_code


async def test_readiness_flips_when_the_only_worker_stops_and_returns(settings_factory, start_worker) -> None:
    """1. No worker: 503, the reason names the model.
    2. A worker warms up: 200 (and the per-model probe too).
    3. The only worker stops: 503 again, naming the model.
    4. It comes back: 200."""
    async with synthetic_gateway(settings_factory) as gw:
        body = (await gw.get("/health/ready")).json()
        assert body["reasons"] == ["no served model has a live worker"]
        assert body["models"]["synthetic"]["reasons"] == ["no live worker"]
        assert await status(gw, "/v1/models/synthetic/ready") == 503
        handle = await start_worker(model="synthetic", worker_name="only")
        await wait_until(lambda: status_is(gw, "/health/ready", 200), 10)
        assert await status(gw, "/v1/models/synthetic/ready") == 200

        assert await handle.stop() == ExitCode.OK
        await wait_until(lambda: status_is(gw, "/health/ready", 503), 10)
        assert (await gw.get("/v1/models/synthetic/ready")).json()["reasons"] == ["no live worker"]

        await start_worker(model="synthetic", worker_name="only")
        await wait_until(lambda: status_is(gw, "/health/ready", 200), 10)
        assert await status(gw, "/v1/models/nope/ready") == 404


async def status_is(client: httpx.AsyncClient, path: str, code: int) -> bool:
    return await status(client, path) == code


async def test_idle_probes_keep_a_healthy_worker_ready(settings_factory, start_worker) -> None:
    """1. A worker idles past probe_interval_s a few times.
    Result: it probes, every probe passes, last_ok_ms moves on and readiness stays 200."""
    async with synthetic_gateway(settings_factory) as gw:
        handle = await start_worker(model="synthetic", probe_interval_s=0.3)
        first_ok = handle.worker.watchdog.last_ok_ms
        await wait_until(lambda: handle.worker.watchdog.probes >= 2, 10)
        assert handle.worker.watchdog.probe_failures == 0
        assert handle.worker.watchdog.last_ok_ms > first_ok
        await wait_until(lambda: status_is(gw, "/health/ready", 200), 5)
        assert not handle.task.done()


@pytest.mark.parametrize(("fault", "reason"), [("cuda_error", "CUDA error"), ("raise", "injected fault")])
async def test_a_failing_probe_makes_the_worker_exit_unhealthy(settings_factory, start_worker, fault, reason) -> None:
    """1. The idle probe hits a CUDA error, or any other error, on known-good inputs (fault injection).
    Result: the worker reports unhealthy, exits ExitCode.UNHEALTHY and readiness says 503."""
    async with synthetic_gateway(settings_factory) as gw:
        handle = await start_worker(model="synthetic", fault_injection=True, probe_fault=fault,
                                    probe_interval_s=2.0)
        await wait_until(lambda: status_is(gw, "/health/ready", 200), 10)
        assert await handle.task == ExitCode.UNHEALTHY
        watchdog = handle.worker.watchdog
        assert watchdog.probe_failures == 1 and reason in (watchdog.unhealthy_reason or "")
        assert handle.worker.stats.state == "unhealthy"
        assert watchdog.heartbeat_fields()["healthy"] == 0
        await wait_until(lambda: status_is(gw, "/health/ready", 503), 10)


async def test_bad_inputs_in_a_row_do_not_restart_a_healthy_worker(settings_factory, start_worker) -> None:
    """1. With max_consecutive_failed_batches=2: five requests in a row whose input makes the
       model raise (fault injection), each a batch of its own.
    Result: each gets 500 model_error; every second failed batch triggers a probe on the
    known-good inputs, which passes, so the count starts over; the worker keeps serving."""
    async with synthetic_gateway(settings_factory) as gw:
        handle = await start_worker(model="synthetic", fault_injection=True, max_consecutive_failed_batches=2)
        await wait_until(lambda: status_is(gw, "/health/ready", 200), 10)

        async def infer(value: object) -> int:
            return (await gw.post("/v1/models/synthetic/infer", json={"inputs": [value]})).status_code

        assert [await infer({"fault": "raise"}) for _ in range(5)] == [500] * 5
        watchdog = handle.worker.watchdog
        assert watchdog.probes == 2 and watchdog.probe_failures == 0 and watchdog.failed_in_row == 1
        assert await infer(1) == 200
        assert not handle.task.done() and watchdog.unhealthy_reason is None


async def test_failed_batches_then_a_failing_probe_make_the_worker_exit(settings_factory, start_worker) -> None:
    """1. With max_consecutive_failed_batches=2: fail, succeed, fail: the success reset the count.
    2. One more failure: two in a row, so the worker probes; the probe fails too (fault injection).
    Result: the worker exits ExitCode.UNHEALTHY naming both; a bad input (422) never counted."""
    async with synthetic_gateway(settings_factory) as gw:
        handle = await start_worker(model="synthetic", fault_injection=True, max_consecutive_failed_batches=2,
                                    probe_fault="raise", probe_interval_s=3600)
        await wait_until(lambda: status_is(gw, "/health/ready", 200), 10)

        async def infer(value: object) -> int:
            return (await gw.post("/v1/models/synthetic/infer", json={"inputs": [value]})).status_code

        assert await infer({"fault": "raise"}) == 500
        assert await infer(1) == 200
        assert await infer({"fault": "raise"}) == 500
        assert not handle.task.done() and handle.worker.watchdog.failed_in_row == 1
        assert await infer({"fault": "raise"}) == 500
        assert await handle.task == ExitCode.UNHEALTHY
        reason = handle.worker.watchdog.unhealthy_reason or ""
        assert "after 2 consecutive batches failed: probe failed" in reason, reason
