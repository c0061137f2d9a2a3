"""The whole path with real processes: `python -m vramguard.gateway` over real HTTP, `python -m vramguard.worker`
processes, a real redis-server, the real minilm model."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from tests.helpers import Stack, wait_until

SENTENCES = [
    "The cat sits on the mat.", "A dog is running in the park.", "Stock markets fell sharply today.",
    "She is reading a book about history.", "The weather will be sunny tomorrow.", "He plays the guitar at night.",
    "Quantum computers use qubits.", "Fresh bread smells wonderful.",
]


def sentence(i: int) -> str:
    return f"{SENTENCES[i % len(SENTENCES)]} (variant {i})"


async def embed(client: httpx.AsyncClient, texts: list[str]) -> np.ndarray:
    response = await client.post("/v1/models/minilm/infer", json={"inputs": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "minilm" and body["request_id"]
    return np.asarray(body["outputs"], dtype=np.float32)


@pytest.mark.slow
async def test_minilm_end_to_end(stack: Stack) -> None:
    stack.start_gateway(served_models="minilm")
    stack.start_worker(model="minilm", models__minilm__max_wait_ms=20)
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        # 1. One embedding per input, in order, L2-normalised, 384 floats.
        pair = await embed(client, ["a sentence", "another one"])
        assert pair.shape == (2, 384)
        np.testing.assert_allclose(np.linalg.norm(pair, axis=1), 1.0, atol=1e-4)

        # 2. Paraphrases are closer than unrelated sentences.
        a, b, c = await embed(client, ["How do I reset my password?", "What are the steps to change my password?",
                                       "The volcano erupted last night."])
        assert float(a @ b) > float(a @ c) + 0.3

        # 3. 64 concurrent requests: each caller gets its own embedding, equal to the single one.
        singles = [await embed(client, [sentence(i)]) for i in range(64)]
        together = await asyncio.gather(*(embed(client, [sentence(i)]) for i in range(64)))
        for i in range(64):
            np.testing.assert_allclose(together[i], singles[i], atol=1e-4)

        # 4. The worker formed batches larger than one while serving them (its heartbeat says so).
        async def beat() -> dict[str, str]:
            (only,) = (await client.get("/v1/models/minilm")).json()["workers"].values()
            return only  # type: ignore[no-any-return]

        async def counted_all() -> bool:
            return int((await beat())["requests"]) >= 64 + 64 + 2

        await wait_until(counted_all, 5)
        assert int((await beat())["max_batch_seen"]) > 1


@pytest.mark.slow
async def test_two_workers_share_the_load(stack: Stack) -> None:
    stack.start_gateway(served_models="synthetic")
    for _ in range(2):
        stack.start_worker(model="synthetic", models__synthetic__params='{"batch_ms": 20}')
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:

        async def both_live() -> bool:
            return (await client.get("/v1/models/synthetic")).json()["live_workers"] == 2

        await wait_until(both_live, 20)
        responses = await asyncio.gather(
            *(client.post("/v1/models/synthetic/infer", json={"inputs": [i]}) for i in range(200))
        )
        assert [r.json()["outputs"] for r in responses] == [[i] for i in range(200)]

        async def counted() -> dict[str, int]:  # as the heartbeats the gateway last read say
            workers = (await client.get("/v1/models/synthetic")).json()["workers"]
            return {w: int(beat["requests"]) for w, beat in workers.items()}

        async def all_counted() -> bool:  # the final counters arrive with a later heartbeat
            return sum((await counted()).values()) >= 200

        await wait_until(all_counted, 10)
        served = await counted()
        assert len(served) == 2 and all(n > 0 for n in served.values()), served
