"""The benchmark's load generator (bench/loadgen.py) against a real stack: its numbers must add
up, and agree with what the worker says it served."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.corpus import load_corpus
from bench.loadgen import body_cycle, run_point
from bench.stats import sum_counters, summarize, worker_view
from tests.helpers import Stack, wait_until

# The benchmark's own tools, not the service: the slow tier (make test-all).
pytestmark = pytest.mark.slow

BATCH_MS = 5.0


async def test_load_generator_counts_add_up(stack: Stack) -> None:
    """1. A gateway and one synthetic worker (5 ms per forward) run as real processes.
    2. The generator drives them for 1 s at concurrency 8, after a 0.3 s warm-up.
    Result: every sampled request has a response and a 200; percentiles are ordered and no
    latency is below the forward's sleep; the throughput is the in-window completions over the
    window; the worker served exactly the requests sent (warm-up + sampled), in batches of 1..8.
    """
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", models__synthetic__params=f'{{"batch_ms": {BATCH_MS}, "item_ms": 0}}')
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url) as client:

        async def counters() -> dict[str, float]:
            return sum_counters((await client.get("/v1/models/synthetic")).json()["workers"])

        before = await counters()
        bodies = body_cycle(load_corpus(), lambda text: {"inputs": [text]})
        run = await run_point(f"{stack.url}/v1/models/synthetic/infer", bodies, concurrency=8, duration_s=1.0,
                              warmup_s=0.3, progress=False)
        sent = run.warmup_requests + len(run.samples)

        async def all_counted() -> bool:
            return (await counters())["requests"] - before["requests"] >= sent

        await wait_until(all_counted, 10)
        after = await counters()

    stats = summarize(run)
    assert stats["requests"] == len(run.samples) > 0
    assert stats["ok"] == stats["requests"] and stats["errors"] == {}
    assert BATCH_MS <= stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    assert all(0 <= s.start_s < run.duration_s for s in run.samples)
    assert 0 < run.ok_in_window == run.completions_in_window <= sent
    assert stats["rps"] == round(run.ok_in_window / run.duration_s, 2)
    assert stats["warmup_errors"] == {} and sum(run.warmup_outcomes.values()) == run.warmup_requests
    assert after["requests"] - before["requests"] == sent
    view = worker_view(before, after)
    assert view["batches"] > 0 and 1.0 <= view["mean_batch"] <= 8.0  # type: ignore[operator]
    assert view["queue_delay_ms"] is not None and view["queue_delay_ms"] >= 0  # type: ignore[operator]


async def test_a_server_that_never_answers_is_reported_not_hidden() -> None:
    """1. A TCP server accepts connections and reads, but never answers.
    2. Two clients start their requests in a 0.3 s warm-up; each times out after 1 s, after the
       0.3 s window has closed, so no request is sampled.
    Result: the point reports 0 requests and 0 req/s, no percentiles (None: JSON has no NaN), and
    the warm-up's timeouts as `warmup_errors`: the stall is visible, not "no errors"."""
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        run = await run_point(f"http://127.0.0.1:{port}/x", lambda: {"inputs": ["a"]}, concurrency=2,
                              duration_s=0.3, warmup_s=0.3, progress=False, request_timeout_s=1.0)
    stats = summarize(run)
    assert stats["requests"] == 0 and stats["rps"] == 0.0 and stats["p50_ms"] is None
    errors = stats["warmup_errors"]
    assert isinstance(errors, dict) and sum(errors.values()) == 2 and all("Timeout" in k for k in errors)
    json.dumps(stats, allow_nan=False)  # valid JSON for the results file
