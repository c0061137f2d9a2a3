"""A gateway that has not counted a prompt yet, hit by a burst of chat requests: it builds the
published tokenizer (SmolLM2's, 1.5 MB of JSON, and transformers' chat-template renderer) once,
off its event loop, and answers every request; it never stalls its own Redis round trips into 503s.

The worker is the synthetic LM (no compute, no tokenizer of its own); the test publishes SmolLM2's
tokenizer for it where a real worker would (worker/generate/loop.py), so the gateway counts prompts
with the real thing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import redis

from tests.helpers import Stack, synthetic_lm_models
from tests.integration.test_model_folder import smollm2_folder
from vramguard.shared.keys import Keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "simlm"
BURST = 32


def publish_smollm2_tokenizer(redis_url: str, key_prefix: str) -> None:
    """What a SmolLM2 worker puts in Redis for the gateways (CausalLMBackend.tokenizer_description)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    fields = {"tokenizer": tokenizer.backend_tokenizer.to_str(), "chat_template": str(tokenizer.chat_template),
              "special": json.dumps(special)}
    redis.Redis.from_url(redis_url).hset(Keys(key_prefix).tokenizer(MODEL), mapping=fields)


async def test_a_burst_at_a_cold_gateway_is_answered_without_503(stack: Stack, tmp_path: Path) -> None:
    """A gateway and a synthetic-LM worker, ready; SmolLM2's tokenizer published for the model; then
    32 chat completions at once, the gateway's first. Result: 32 x 200, each with its usage (the
    prompt counted by the gateway's tokenizer is within the window: nothing refused)."""
    common = {"models_file": str(synthetic_lm_models(tmp_path, window=4096, max_batch_size=BURST)),
              "served_models": MODEL}
    stack.start_gateway(**common)
    stack.start_worker(model=MODEL, **common)
    await stack.wait_ready()
    publish_smollm2_tokenizer(stack.redis_url, str(stack.settings["key_prefix"]))

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        bodies = [{"model": MODEL, "max_tokens": 2, "temperature": 0,
                   "messages": [{"role": "user", "content": f"question number {i}, asked once"}]}
                  for i in range(BURST)]
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert [r.status_code for r in replies] == [200] * BURST, {r.text for r in replies if r.status_code != 200}
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in replies)
