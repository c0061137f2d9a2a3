"""Text generation inside the KV-cache plan on the simulated device: the synthetic generative
model (worker/generate/synthetic_lm.py), served from a models file as a user's model would be."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack, wait_until

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
    a step's activations, then a KV cache of 64 KiB per token (copied two layers of 8 at a time).
    2. 64 concurrent completions of 150 tokens each (prompt 10 + 150 = 160 tokens reserved per
    sequence): far more than the cache holds at once.
    Result: all 64 finish with 150 tokens; no OOM; the simulated device's peak stays within the
    worker's budget and the KV cache's within its plan; fewer than 64 ran at once (the rest waited
    in the stream); and the cache is empty again at the end."""
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

        async def beat() -> dict[str, object]:
            workers = (await client.get("/v1/models/simlm")).json()["workers"]
            return next(iter(workers.values()))  # type: ignore[no-any-return]

        async def all_counted() -> bool:
            generation = str((await beat())["generation"])
            return json.loads(generation)["finished"] >= 64 and json.loads(generation)["kv_bytes_used"] == 0

        await wait_until(all_counted, 20)
        worker = await beat()
    generation = json.loads(str(worker["generation"]))
    plan = generation["kv_plan"]
    assert worker["oom_events"] == 0 and generation["failed"] == 0
    assert worker["mem_peak_bytes"] <= worker["mem_budget_bytes"]  # type: ignore[operator]
    assert 0 < generation["kv_bytes_peak"] <= plan["kv_budget_bytes"]
    assert plan["bytes_per_token"] == plan["measured_bytes_per_token"] == 64 * 1024
    assert plan["tokens_fit"] // 160 < 64  # the plan, not max_batch_size, bounded the running sequences
