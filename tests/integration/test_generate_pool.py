"""The paged KV pool with real gateway and worker processes: preemption when the pool is full, the
step's token budget for arriving requests. The synthetic generative model on the CPU (no
simulated device): its pool is transformers' PagedAttentionCache on the meta device, the same
block bookkeeping a real model's pool runs, without a real model's CPU cost. Its text is known:
token t + 1 follows token t, so any lost or repeated token shows."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import RedisServer, Stack, wait_until
from vramguard.shared.keys import Keys

pytestmark = pytest.mark.slow  # real processes, 30-90 s each on 2 busy cores

MODELS_FILE = """
[simlm]
backend = "vramguard.worker.generate.synthetic_lm:SyntheticLMBackend"
description = "synthetic generative model (tests)"
input_kind = "json"
output = {{ kind = "json", keys = ["next_token"] }}
options = {{ generates = true, context_window = 4096 }}
defaults = {{ max_batch_size = 64, max_wait_ms = {max_wait_ms}, default_timeout_ms = 300000, params = {{ {params} }} }}
"""


async def start(stack: Stack, tmp_path: Path, params: str, max_wait_ms: float = 1.0) -> None:
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE.format(params=params, max_wait_ms=max_wait_ms))
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(**common)
    stack.start_worker(model="simlm", device="cpu", **common)
    await stack.wait_ready()


def expected_text(last_prompt_token: int, tokens: int) -> str:
    return "".join(f" w{last_prompt_token + k}" for k in range(1, tokens + 1))


async def beat(client: httpx.AsyncClient) -> dict[str, Any]:
    workers = (await client.get("/v1/models/simlm")).json()["workers"]
    return next(iter(workers.values()))  # type: ignore[no-any-return]


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """The sum of one /metrics sample over its labels (one worker here)."""
    text = (await client.get("/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def completion(prompt: str, max_tokens: int) -> dict[str, object]:
    return {"model": "simlm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


@pytest.mark.timeout(300)
async def test_a_full_pool_preempts_and_every_text_is_the_one_run_alone(stack: Stack, tmp_path: Path) -> None:
    """1. One worker whose pool holds 1040 tokens (65 blocks of 16): 8 sequences of 2 + 128 tokens.
    2. Two requests alone, one after the other; then 32 concurrent greedy 128-token completions.
    Result: all 32 finish; each text is the model's own (token t + 1 after t) and the two run alone
    are the same as in the crowd: no token lost or repeated by preemption and re-prefill; sequences
    were preempted (counted on /metrics); no OOM, no failure; the pool holds no block at the end."""
    await start(stack, tmp_path, "pool_tokens = 1040.0, step_ms = 0.0")
    prompts = ["a " + "b" * (i + 1) for i in range(32)]  # tokens 2 and 2 + i (1 + a word's length)
    async with httpx.AsyncClient(base_url=stack.url, timeout=240) as client:
        alone = [(await client.post("/v1/completions", json=completion(prompts[i], 128))).json() for i in (0, 31)]
        responses = await asyncio.gather(*(client.post("/v1/completions", json=completion(p, 128)) for p in prompts))
        assert [r.status_code for r in responses] == [200] * 32, {r.text for r in responses if r.status_code != 200}
        texts = [r.json()["choices"][0]["text"] for r in responses]
        assert texts == [expected_text(2 + i, 128) for i in range(32)]
        assert [a["choices"][0]["text"] for a in alone] == [texts[0], texts[31]]

        async def all_counted() -> bool:
            generation = (await beat(client))["generation"]
            return generation["finished"] >= 34 and generation["kv_blocks_used"] == 0  # type: ignore[no-any-return]

        await wait_until(all_counted, 20)
        worker = await beat(client)
        preempted = await metric(client, "vramguard_generation_preemptions_total")
    generation = worker["generation"]
    assert generation["kv_plan"]["num_blocks"] == 65
    assert generation["preemptions"] > 0 and preempted == generation["preemptions"]
    assert worker["oom_events"] == 0 and generation["failed"] == 0


@pytest.mark.timeout(300)
async def test_a_request_behind_31_long_generations_gets_its_first_token_within_3_steps(
        stack: Stack, tmp_path: Path) -> None:
    """1. One worker with a large pool and a 64-token step budget (step_ms 20: a step is slow next
    to the client, as a real model's is).
    2. 31 long completions (2000 tokens); once all 31 decode, a 64-token completion arrives.
    Result: it is answered in full while the long ones still run, and its first token came within
    3 steps of the worker reading it (the step counter, not the clock): the budget fits the 31
    decodes and its prompt in one step."""
    await start(stack, tmp_path, "token_budget = 64.0, step_ms = 20.0")
    async with httpx.AsyncClient(base_url=stack.url, timeout=240) as client:
        long = [asyncio.ensure_future(client.post("/v1/completions", json=completion(f"long {'x' * (i + 1)}", 2000)))
                for i in range(31)]

        async def all_decoding() -> bool:
            generation = (await beat(client))["generation"]
            return generation["running"] == 31 and generation["first_token_steps_max"] > 0  # type: ignore[no-any-return]

        await wait_until(all_decoding, 60)
        short = await client.post("/v1/completions", json=completion("short one", 64))
        assert short.status_code == 200 and short.json()["choices"][0]["text"] == expected_text(4, 64)

        async def short_counted() -> bool:  # a heartbeat written after the short one finished
            return (await beat(client))["generation"]["finished"] >= 1  # type: ignore[no-any-return]

        await wait_until(short_counted, 10)
        generation = (await beat(client))["generation"]
        assert generation["first_token_steps_last"] <= 3, generation
        assert not any(f.done() for f in long)
        for f in long:
            f.cancel()


@pytest.mark.timeout(120)
async def test_an_idle_worker_reads_a_burst_before_its_first_step_and_starts_a_lone_request_at_once(
        stack: Stack, tmp_path: Path) -> None:
    """1. One worker with a 3 s admission window (max_wait_ms) and 20 ms steps.
    2. On the fresh worker, a 1-token completion alone, and another 600 ms later.
    3. Two 50-token completions at once (they run side by side); once they finished, a 1-token
       completion, and another 600 ms later.
    Result (the step counter, not the clock): in 2 two steps, the first request did not wait for
    the window; in 3 one step for the last two, the worker, which had just run two sequences at
    once, held the window open for the second before its first step. Every text is the model's."""
    await start(stack, tmp_path, "step_ms = 20.0", max_wait_ms=3000.0)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:

        async def steps_after(finished: int) -> int:
            async def counted() -> bool:  # a heartbeat written after the last one finished
                return (await beat(client))["generation"]["finished"] >= finished  # type: ignore[no-any-return]

            await wait_until(counted, 10)
            return int((await beat(client))["generation"]["steps"])

        async def one_then_another() -> list[str]:
            first = asyncio.ensure_future(client.post("/v1/completions", json=completion("a b", 1)))
            await asyncio.sleep(0.6)
            second = await client.post("/v1/completions", json=completion("a bb", 1))
            return [r.json()["choices"][0]["text"] for r in (await first, second)]

        assert await one_then_another() == [expected_text(2, 1), expected_text(3, 1)]
        assert await steps_after(2) == 2
        pair = await asyncio.gather(*(client.post("/v1/completions", json=completion(p, 50)) for p in ("a b", "a bb")))
        assert [r.json()["choices"][0]["text"] for r in pair] == [expected_text(2, 50), expected_text(3, 50)]
        before = await steps_after(4)
        assert await one_then_another() == [expected_text(2, 1), expected_text(3, 1)]
        assert await steps_after(6) == before + 1


SYSTEM = " ".join("abcdefgh"[: 1 + i % 8] for i in range(300))  # 300 tokens (a token per word)


async def held_blocks_at_peak(client: httpx.AsyncClient, prompts: list[str], finished: int) -> tuple[int, list[str]]:
    """Run `prompts` concurrently (32 tokens each: the last is admitted before the first ends); the
    most blocks held at once since start, once they are all counted, and their texts."""
    responses = await asyncio.gather(*(client.post("/v1/completions", json=completion(p, 32)) for p in prompts))
    assert [r.status_code for r in responses] == [200] * len(prompts)

    async def counted() -> bool:
        generation = (await beat(client))["generation"]
        return generation["finished"] >= finished and generation["kv_blocks_used"] == 0  # type: ignore[no-any-return]

    await wait_until(counted, 20)
    generation = (await beat(client))["generation"]
    plan = generation["kv_plan"]
    peak = generation["kv_bytes_peak"] // (plan["block_tokens"] * plan["bytes_per_token"])
    return peak, [r.json()["choices"][0]["text"] for r in responses]


@pytest.mark.timeout(300)
async def test_a_shared_300_token_system_prompt_holds_fewer_blocks(stack: Stack, tmp_path: Path) -> None:
    """1. One worker with prefix sharing: 16 concurrent completions whose prompts are the same
    300-token system prompt and a question of their own; then 16 whose system prompts differ in
    their first word.
    2. A worker without prefix sharing: the 16 shared-prompt completions again.
    Result: the shared ones took their prefix from the pool (prefix hits) and held at their peak
    fewer blocks than the distinct ones then did (the pool's counters); the texts are the same with
    and without sharing."""
    await start(stack, tmp_path, "step_ms = 2.0")
    shared = [f"{SYSTEM} question{'x' * i}" for i in range(16)]
    distinct = [f"{'y' * (i + 1)}{SYSTEM} question" for i in range(16)]
    async with httpx.AsyncClient(base_url=stack.url, timeout=240) as client:
        shared_peak, with_sharing = await held_blocks_at_peak(client, shared, 16)
        hits = (await beat(client))["generation"]["prefix_hits"]
        distinct_peak, _ = await held_blocks_at_peak(client, distinct, 32)
    stack.workers[0].send_signal(signal.SIGTERM)
    assert stack.workers[0].wait(timeout=60) == 0
    models = str(tmp_path / "models.toml")
    no_sharing = MODELS_FILE.format(params="step_ms = 2.0, prefix_sharing = 0.0", max_wait_ms=1.0)
    (tmp_path / "models.toml").write_text(no_sharing)
    stack.start_worker(model="simlm", device="cpu", models_file=models, served_models="simlm")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=240) as client:
        unshared_peak, without = await held_blocks_at_peak(client, shared, 16)
    assert hits >= 8
    assert shared_peak < distinct_peak and shared_peak < unshared_peak
    assert distinct_peak >= 16 * 19  # each its own 19 blocks of prompt
    assert with_sharing == without


@pytest.mark.timeout(300)
async def test_the_worker_reads_only_what_its_pool_can_admit(stack: Stack, tmp_path: Path,
                                                             redis_server: RedisServer, key_prefix: str) -> None:
    """1. One worker whose pool holds 160 tokens (10 blocks: about 5 admissions of a 2-token prompt
    at 2 blocks each), 20 ms a step.
    2. 32 concurrent 64-token completions.
    Result: while they run, most of them stay unread in the stream (pending in the consumer group
    stays at what the pool admits, not the 64 rows max_batch_size allows), where an idle worker could
    take them; all 32 finish."""
    await start(stack, tmp_path, "pool_tokens = 160.0, step_ms = 20.0")
    redis = aioredis.Redis.from_url(redis_server.url)
    stream = Keys(key_prefix).request_stream("simlm")
    most_pending = 0
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=240) as client:
            calls = asyncio.gather(*(client.post("/v1/completions", json=completion(f"w {'x' * (i + 1)}", 64))
                                     for i in range(32)))
            task = asyncio.ensure_future(calls)
            while not task.done():
                if await redis.exists(stream):
                    groups = await redis.xinfo_groups(stream)
                    most_pending = max(most_pending, *(int(g["pending"]) for g in groups))
                await asyncio.sleep(0.05)
            responses = await task
    finally:
        await redis.aclose()
    assert [r.status_code for r in responses] == [200] * 32
    assert 0 < most_pending <= 10  # the pool's 10 blocks bound what is read, not max_batch_size (64)
