"""Text generation inside the KV-cache plan on the simulated device: the synthetic generative
model (worker/generate/synthetic_lm.py), served from a models file as a user's model would be."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.helpers import RedisServer, Stack, wait_until
from vramguard.shared.keys import Keys

MIB = 1024 * 1024
MODELS_FILE = """
[simlm]
backend = "vramguard.worker.generate.synthetic_lm:SyntheticLMBackend"
description = "synthetic generative model (tests)"
input_kind = "json"
output = { kind = "json", keys = ["next_token"] }
options = { generates = true, context_window = 4096 }
defaults = { max_batch_size = 64, max_wait_ms = 1.0, default_timeout_ms = 300000 }
"""


@pytest.mark.slow
@pytest.mark.timeout(420)  # 64 x 150 steps on the CPU took over 120 s on 2 busy cores
async def test_64_long_generations_on_a_small_simulated_device(stack: Stack, tmp_path: Path) -> None:
    """1. One worker on a 256 MiB simulated device (budget 0.8 x 256 = 204.8 MiB): weights 64 MiB,
    a step's activations (measured with a cache present: 1 KiB per cached token the step reads),
    then one KV pool of 64 KiB per token, taken from the simulated allocator once.
    2. 64 concurrent completions of 150 tokens each (prompt 10 + 150 = 160 tokens at their largest):
    far more than the pool holds at once.
    Result: all 64 finish with 150 tokens; no OOM; the simulated device's peak stays within the
    worker's budget, the pool and the step's planned peak within the plan; the step's read cost was
    measured (not fitted on cache-less prefills); the pool bounded the sequences (fewer than 64 at
    their largest fit it); and no block is held at the end."""
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE)
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(**common)
    stack.start_worker(model="simlm", device="sim", sim_memory_bytes=256 * MIB, **common)
    await stack.wait_ready()
    prompt = " ".join(["word"] * 10)
    async with httpx.AsyncClient(base_url=stack.url, timeout=300) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": "simlm", "prompt": prompt, "max_tokens": 150, "temperature": 0}) for _ in range(64)))
        assert [r.status_code for r in responses] == [200] * 64, {r.text for r in responses if r.status_code != 200}
        assert {r.json()["usage"]["completion_tokens"] for r in responses} == {150}

        async def beat() -> dict[str, Any]:
            workers = (await client.get("/v1/models/simlm")).json()["workers"]
            return next(iter(workers.values()))

        async def all_counted() -> bool:
            generation = (await beat())["generation"]
            return generation["finished"] >= 64 and generation["kv_blocks_used"] == 0  # type: ignore[no-any-return]

        await wait_until(all_counted, 20)
        worker = await beat()
    generation = worker["generation"]
    plan = generation["kv_plan"]
    assert worker["oom_events"] == 0 and generation["failed"] == 0
    assert worker["mem_peak_bytes"] <= worker["mem_budget_bytes"]
    assert plan["context_bytes"] + plan["weights_bytes"] + plan["step_peak_bytes"] + plan["pool_bytes"] \
        <= plan["budget_bytes"]
    assert 0 < generation["kv_bytes_peak"] <= plan["pool_bytes"]
    assert plan["bytes_per_token"] == plan["measured_bytes_per_token"] == 64 * 1024
    assert plan["read_bytes_per_token"] == 1024  # the synthetic model's read_kib, measured over a cache
    assert plan["tokens_fit"] // 160 < 64  # the pool, not max_batch_size, bounded the sequences at their largest
    assert generation["kv_tokens_held"] == 0 and generation["running"] == 0


OOM_MODELS_FILE = MODELS_FILE.replace("default_timeout_ms = 300000", "default_timeout_ms = 300000, "
                                     "params = { step_token_kib = 4096.0, step_ms = 20.0, pool_tokens = 640.0 }")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_oom_inside_a_step_runs_the_sequences_again_in_fewer_rows(stack: Stack, tmp_path: Path) -> None:
    """1. One worker on a 256 MiB simulated device with the planner off (so the KV plan leaves no
    room for a step's activations; the pool is capped at 640 tokens, 40 MiB): a step costs 4 MiB +
    4 MiB per token it computes, so a step of about 20 tokens or more runs out of memory; the probe
    steps at start find that and keep the token budget below it, but decodes are not held to it.
    2. A 64-word prompt alone, then 32 concurrent 2-word prompts of 40 tokens, greedy.
    Result: the long prompt is answered (prefilled in chunks of the budget); the 32 all get 200 with
    exactly the uncut greedy text (no token lost or repeated by the retried steps); the worker
    counted OOM events (decode steps of too many rows) and no failed sequence; no block is held at the end."""
    models = tmp_path / "models.toml"
    models.write_text(OOM_MODELS_FILE)
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(**common)
    stack.start_worker(model="simlm", device="sim", sim_memory_bytes=256 * MIB, memory_planner=False, **common)
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=240) as client:
        alone = await client.post("/v1/completions", json={
            "model": "simlm", "prompt": " ".join(["word"] * 64), "max_tokens": 4, "temperature": 0})
        assert alone.status_code == 200, alone.text
        assert alone.json()["choices"][0]["text"] == " w6 w7 w8 w9"  # "word" is token 5
        responses = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": "simlm", "prompt": "a " + "b" * (i + 1), "max_tokens": 40, "temperature": 0}) for i in range(32)))
        assert [r.status_code for r in responses] == [200] * 32, {r.text for r in responses if r.status_code != 200}
        for i, r in enumerate(responses):  # the synthetic model answers token t + 1 after token t
            last = 2 + i  # the prompt's last token: 1 + its word's length
            assert r.json()["choices"][0]["text"] == "".join(f" w{last + k}" for k in range(1, 41)), i

        async def beat() -> dict[str, Any]:
            workers = (await client.get("/v1/models/simlm")).json()["workers"]
            return next(iter(workers.values()))

        async def all_counted() -> bool:
            generation = (await beat())["generation"]
            return generation["finished"] >= 33 and generation["kv_blocks_used"] == 0  # type: ignore[no-any-return]

        await wait_until(all_counted, 20)
        worker = await beat()
    generation = worker["generation"]
    assert worker["oom_events"] >= 1  # a decode step of too many rows
    assert generation["failed"] == 0 and generation["finished"] == 33
    # vramguard_worker_adaptive_batch_cap: the rows a step may run after the OOMs (a step runs out
    # at about 20 tokens, so they settle near 10; 10 in a run), not the batch plan's item cap, which
    # every OOM halved down to 1
    assert 4 <= worker["adaptive_batch_cap"] < generation["kv_plan"]["max_running"], worker["adaptive_batch_cap"]


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_gateway_shutdown_ends_an_open_stream_with_an_error_event(stack: Stack, tmp_path: Path) -> None:
    """1. A gateway process with shutdown_delay_s 1 streams a long generation (the synthetic
    model, 20 ms a step, 1000 tokens) to a real HTTP client.
    2. After a few chunks the gateway gets SIGTERM.
    Result: the stream's last event is an error in OpenAI's shape (code unavailable), sent after
    the shutdown delay, then the stream ends (no cut connection) and the gateway exits 0."""
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE.replace("default_timeout_ms = 300000", "default_timeout_ms = 300000, "
                                          "params = { step_ms = 20.0 }"))
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(shutdown_delay_s=1.0, **common)
    stack.start_worker(model="simlm", device="sim", sim_memory_bytes=512 * MIB, **common)
    await stack.wait_ready()
    body = {"model": "simlm", "prompt": "hello there", "max_tokens": 1000, "temperature": 0, "stream": True}
    events: list[dict[str, object]] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue  # the blank line after each event must not signal a second time
                events.append(json.loads(line[6:]))
                if len(events) == 5:  # one SIGTERM: a second one is uvicorn's exit-now
                    stack.gateway.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
            ended = time.monotonic()
    error = events[-1]["error"]
    assert isinstance(error, dict) and error["code"] == "unavailable" and error["type"] == "server_error", error
    assert "request_id" in error and "message" in error and error["param"] is None  # OpenAI's error shape
    assert ended - signalled >= 1.0  # served on for the shutdown delay first
    assert all("choices" in e for e in events[:-1]) and len(events) > 5
    assert stack.gateway.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_killed_gateways_sequences_stop_once_its_reply_stream_expires(
        stack: Stack, tmp_path: Path, redis_server: RedisServer, key_prefix: str) -> None:
    """1. A gateway with reply_stream_ttl_s 5 streams a long generation (the synthetic model, 40 ms
    a step, 1200 tokens: about 48 s) to a real HTTP client.
    2. After a few chunks the gateway is SIGKILLed: the client's connection is cut, and no gateway
    is left to set the request's cancel key.
    Result: once the dead gateway's reply stream expires, the worker stops the sequence (counted
    cancelled, not finished) well before its 1200 tokens, and the KV cache is empty again."""
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE.replace("default_timeout_ms = 300000", "default_timeout_ms = 300000, "
                                          "params = { step_ms = 40.0 }"))
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(reply_stream_ttl_s=5, **common)
    stack.start_worker(model="simlm", device="sim", sim_memory_bytes=512 * MIB, **common)
    await stack.wait_ready()
    body = {"model": "simlm", "prompt": "hello there", "max_tokens": 1200, "temperature": 0, "stream": True}
    chunks = 0
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 5:
                        stack.gateway.kill()
                        chunks += 1  # kill once
        except httpx.HTTPError:
            pass  # the connection was cut with the gateway (or read to its end, as the kernel closed it)
    assert stack.gateway.wait(timeout=10) == -signal.SIGKILL
    redis = aioredis.Redis.from_url(redis_server.url)

    async def generation() -> dict[str, Any]:
        (key,) = [k async for k in redis.scan_iter(match=Keys(key_prefix).heartbeat("*"))]
        return json.loads(await redis.hget(key, "generation"))  # type: ignore[no-any-return]

    async def stopped() -> bool:
        # The heartbeat is written on an interval: one written before the sequence was admitted
        # also says running 0, so wait for the sequence to be counted as ended in either way.
        stats = await generation()
        return stats["running"] == 0 and stats["cancelled"] + stats["finished"] >= 1

    try:
        await wait_until(stopped, 60)
        stats = await generation()
    finally:
        await redis.aclose()
    assert stats["cancelled"] == 1 and stats["finished"] == 0, stats
    assert stats["tokens_generated"] < 1200 and stats["kv_bytes_used"] == 0, stats


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_generations_lost_with_redis_data_fail_fast_then_service_resumes(
        stack: Stack, tmp_path: Path, redis_server: RedisServer) -> None:
    """1. A streamed and a whole generation run (the synthetic model, 40 ms a step, 1000 tokens).
    2. Redis loses its data (FLUSHDB, as a restart without persistence).
    Result: the stream ends with an error event (code unavailable) and the whole request is 503,
    both within seconds, not at their deadline; the next generation is answered."""
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE.replace("default_timeout_ms = 300000", "default_timeout_ms = 300000, "
                                          "params = { step_ms = 40.0 }"))
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(**common)
    stack.start_worker(model="simlm", device="sim", sim_memory_bytes=512 * MIB, **common)
    await stack.wait_ready()
    body = {"model": "simlm", "prompt": "hello there", "max_tokens": 500, "temperature": 0}
    redis = aioredis.Redis.from_url(redis_server.url)
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        whole = asyncio.ensure_future(client.post("/v1/completions", json=body))
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        await redis.flushdb()
                        flushed = time.monotonic()
        ended = time.monotonic()
        lost = await whole
        await redis.aclose()

        async def answered() -> bool:
            again = await client.post("/v1/completions", json={**body, "max_tokens": 3})
            return again.status_code == 200
        await wait_until(answered, 30)
    assert events[-1]["error"]["code"] == "unavailable", events[-1]
    assert lost.status_code == 503 and lost.json()["error"]["code"] == "unavailable", lost.text
    assert ended - flushed < 10  # 500 tokens at 40 ms would take 20 s
