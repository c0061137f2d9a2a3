"""Structured logs from real processes: one JSON line per event on stderr, with the fields a log
search needs (request_id, model, batch_size, queue_delay_ms, duration_ms); uvicorn's access log
only when the setting turns it on; secrets masked."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack


def events(path: Path) -> list[dict[str, object]]:
    """Every line of a log file parsed as JSON (a non-JSON line fails the test)."""
    parsed = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                parsed.append(json.loads(line))
            except json.JSONDecodeError:
                raise AssertionError(f"{path.name} line {number} is not JSON: {line!r}") from None
    return parsed


@pytest.mark.slow
async def test_logs_are_json_lines_with_the_event_fields(stack: Stack, tmp_path: Path) -> None:
    """1. A gateway with VRAMGUARD_ACCESS_LOG=true and a worker with an API key set run.
    2. One good request, one that the model fails.
    Result: both logs are JSON lines; the worker logs its settings with the key masked and each
    batch with batch_size, queue_delay_ms and duration_ms; the gateway logs the failed request
    with its request_id and outcome, and uvicorn's access lines."""
    stack.start_gateway(served_models="synthetic", access_log="true")
    stack.start_worker(model="synthetic", fault_injection="true", api_key="s3cret-key")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        assert (await client.post("/v1/models/synthetic/infer", json={"inputs": [1]})).status_code == 200
        failed = await client.post("/v1/models/synthetic/infer", json={"inputs": [{"fault": "raise"}]})
        assert failed.status_code == 500
    stack.stop()

    worker = events(tmp_path / "worker-0.log")
    assert "s3cret-key" not in (tmp_path / "worker-0.log").read_text()
    (ready,) = [e for e in worker if e["message"] == "worker ready"]
    assert ready["settings"]["api_key"] == "***" and ready["worker_id"] == "test-worker-0"  # type: ignore[index]
    batches = [e for e in worker if e["message"] == "batch done"]
    assert len(batches) == 2 and all({"batch_size", "queue_delay_ms", "duration_ms", "worker_id", "model"} <= set(e)
                                     for e in batches)

    gateway = events(tmp_path / "gateway.log")
    (done,) = [e for e in gateway if e["message"] == "request done"]
    assert done["outcome"] == "model_error" and done["request_id"] == failed.json()["error"]["request_id"]
    assert any(e["logger"] == "uvicorn.access" for e in gateway)
    assert all(e["service"] == "gateway" for e in gateway)


@pytest.mark.slow
async def test_the_access_log_is_off_by_default(stack: Stack, tmp_path: Path) -> None:
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        assert (await client.get("/health/live")).status_code == 200
    stack.stop()
    assert not any(e["logger"] == "uvicorn.access" for e in events(tmp_path / "gateway.log"))


@pytest.mark.slow
async def test_a_minilm_worker_writes_json_lines_only(stack: Stack, tmp_path: Path) -> None:
    """1. A minilm worker starts (its weights load through transformers, which draws tqdm bars).
    Result: every line of its log (stdout and stderr) is JSON: no "Loading weights: 100%|..." text."""
    stack.start_gateway(served_models="minilm")
    stack.start_worker(model="minilm")
    await stack.wait_ready()
    stack.stop()
    assert any(e["message"] == "worker ready" for e in events(tmp_path / "worker-0.log"))
