"""The heartbeat's `kv_tokens_held`: the token states a generative worker's KV pool holds for its
sequences, the unused tail of their last blocks left out (the generation suite's KV utilisation is
this over the plan's `tokens_fit`). The synthetic generative model on the simulated device, served
from a models file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

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
defaults = { max_batch_size = 8, max_wait_ms = 1.0, default_timeout_ms = 300000, params = { step_ms = 100.0 } }
"""


@pytest.mark.slow  # a worker's start and 60 steps of 100 ms: 30-40 s on 2 busy cores
async def test_kv_tokens_held_counts_each_sequences_context_not_whole_blocks(stack: Stack, tmp_path: Path) -> None:
    """1. One simlm worker, 100 ms per step; two completions at once, prompts of 10 and 30 words,
    60 tokens each.
    Result: while both run, the heartbeat's kv_tokens_held lies between their prompts (40) and
    their prompts plus everything they may generate (160), is what kv_bytes_used counts, and is at
    most the tokens of the blocks they hold (kv_bytes_reserved / bytes_per_token); once they
    finish, it is 0."""
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE)
    common = {"models_file": str(models), "served_models": "simlm"}
    stack.start_gateway(**common)
    stack.start_worker(model="simlm", device="sim", sim_memory_bytes=256 * MIB, **common)
    await stack.wait_ready()
    seen: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        async def generation() -> dict[str, Any]:
            workers = (await client.get("/v1/models/simlm")).json()["workers"]
            return next(iter(workers.values()))["generation"]  # type: ignore[no-any-return]

        def tokens(g: dict[str, Any], field: str) -> int:
            return int(g[field] // g["kv_plan"]["bytes_per_token"])

        async def both_running() -> bool:  # both prompts prefilled into the pool, not one still waiting
            seen.append(await generation())
            return seen[-1]["running"] == 2 and seen[-1]["kv_tokens_held"] > 40

        requests = [asyncio.create_task(client.post("/v1/completions", json={
            "model": "simlm", "prompt": " ".join(["word"] * words), "max_tokens": 60, "temperature": 0}))
            for words in (10, 30)]
        await wait_until(both_running, 60)
        replies = await asyncio.gather(*requests)
        assert [r.status_code for r in replies] == [200, 200]

        async def idle() -> bool:
            return (await generation())["kv_tokens_held"] == 0  # type: ignore[no-any-return]

        await wait_until(idle, 20)
    during = seen[-1]
    assert 40 < during["kv_tokens_held"] <= 160
    assert during["kv_tokens_held"] == tokens(during, "kv_bytes_used")
    assert during["kv_tokens_held"] <= tokens(during, "kv_bytes_reserved")  # whole blocks held cover it
