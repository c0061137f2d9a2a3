"""The paged KV pool with the real SmolLM2-135M-Instruct on the CPU, real gateway and worker
processes: prompts that share a 300-token system prompt share its blocks, and neither sharing nor
preemption changes a greedy text. (How many blocks sharing saves is counted with the synthetic
model, which costs no compute: test_generate_pool.py.)"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Stack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely." for i in range(1, 43))  # about 300 tokens
QUESTIONS = [f"What is {i} plus {i}?" for i in range(16)]


def chat(system: str, question: str, max_tokens: int) -> dict[str, object]:
    return {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def worker_settings(**params: float) -> dict[str, object]:
    return {"model": "smollm2", "torch_threads": 1, "models__smollm2__params": json.dumps(params)}


async def generation(client: httpx.AsyncClient) -> dict[str, Any]:
    workers = (await client.get("/v1/models/smollm2")).json()["workers"]
    return next(iter(workers.values()))["generation"]  # type: ignore[no-any-return]


async def texts(client: httpx.AsyncClient, bodies: list[dict[str, object]]) -> tuple[list[str], int]:
    """The replies' texts, concurrently, and the longest prompt in tokens."""
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), {r.text for r in responses}
    replies = [r.json() for r in responses]
    return [r["choices"][0]["message"]["content"] for r in replies], max(r["usage"]["prompt_tokens"] for r in replies)


async def settled(client: httpx.AsyncClient, finished: int) -> dict[str, Any]:
    """The heartbeat once `finished` sequences are counted and no block is held."""
    async def done() -> bool:
        stats = await generation(client)
        return stats["finished"] >= finished and stats["kv_blocks_used"] == 0  # type: ignore[no-any-return]

    await wait_until(done, 30)
    return await generation(client)


async def story_texts(client: httpx.AsyncClient, indexes: list[int]) -> list[str]:
    bodies = [{"model": "smollm2", "prompt": f"Once upon a time, in village number {i}, there lived",
               "max_tokens": 48, "temperature": 0} for i in indexes]
    responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), {r.text for r in responses}
    return [r.json()["choices"][0]["text"] for r in responses]


async def test_shared_prompts_and_preemption_change_no_text(stack: Stack) -> None:
    """1. A worker with prefix sharing and a pool of 48 blocks of 16 tokens: 16 concurrent greedy
    chats with the same ~300-token system prompt; then 16 concurrent 48-token story completions
    (each a block of prompt, 4 at the end: 64 blocks in all), then two of them alone.
    2. A worker without prefix sharing: the same 16 chats.
    Result: the chats found their prefix in the pool; the full pool preempted sequences (counted on
    /metrics); every story is the one run alone, and the chats' texts are the same with and without
    sharing; no OOM, no failure."""
    shared = [chat(SYSTEM, q, 16) for q in QUESTIONS]
    stack.start_gateway(served_models="smollm2")
    first = stack.start_worker(**worker_settings(pool_tokens=48 * 16))
    await stack.wait_ready(timeout_s=300)
    async with httpx.AsyncClient(base_url=stack.url, timeout=800) as client:
        with_sharing, _ = await texts(client, shared)
        stories = await story_texts(client, list(range(16)))
        alone = [(await story_texts(client, [i]))[0] for i in (0, 15)]
        stats = await settled(client, 34)
        workers = (await client.get("/v1/models/smollm2")).json()["workers"]
        scrape = (await client.get("/metrics")).text
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        stack.start_worker(**worker_settings(prefix_sharing=0))
        await stack.wait_ready(timeout_s=300)
        without, _ = await texts(client, shared)
        unshared = await settled(client, 16)
    assert stats["prefix_hits"] >= 8 and stats["prefix_hit_tokens"] >= 8 * 256
    preempted = sum(s.value for f in text_string_to_metric_families(scrape) for s in f.samples
                    if s.name == "vramguard_generation_preemptions_total")
    assert stats["preemptions"] > 0 and preempted == stats["preemptions"]
    assert alone == [stories[0], stories[15]]
    assert with_sharing == without and unshared["prefix_hits"] == 0
    assert stats["kv_plan"]["num_blocks"] == 48 and stats["failed"] == 0
    assert [w["oom_events"] for w in workers.values()] == [0]
