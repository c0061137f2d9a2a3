"""`python -m bench.generate`: text generation with SmolLM2-135M on the CPU (one torch thread):
tokens/s and time to first token at several concurrencies for

- the in-process limit: the worker's own engine (worker/generate/engine.py) run directly, all
  sequences admitted at once, no HTTP and no Redis;
- vramguard: gateway + Redis + one worker, streamed OpenAI completions (openai's async client);
- naive: a FastAPI endpoint running `generate` per request (bench/peers/naive_generate.py).

Every request asks for exactly `--max-tokens` tokens (greedy, end token ignored where the path
allows it; prompts that do not end early). Writes bench/results/generate.json and prints it.
LitServe is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a lighthouse keeper named {i}, who"


def in_process(concurrency: int, max_tokens: int) -> dict[str, float]:
    """The engine alone: `concurrency` sequences join at once and run `max_tokens` steps."""
    import torch

    from vramguard.shared.settings import Settings
    from vramguard.worker.generate.causal_lm import CausalLMBackend
    from vramguard.worker.generate.engine import Engine
    from vramguard.worker.generate.sampling import SamplingParams
    from vramguard.worker.generate.sequence import Sequence

    torch.set_num_threads(1)
    settings = Settings(model="smollm2", served_models=["smollm2"])
    backend = CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)
    backend.load()
    engine = Engine(backend)
    started = time.monotonic()
    seqs = []
    for i in range(concurrency):
        seq = Sequence(request_id=str(i), entry_id=str(i), reply_to="", deadline_ms=0,  # type: ignore[arg-type]
                       prompt_ids=backend.prompt_ids(PROMPT.format(i=i), {}), max_tokens=max_tokens,
                       sampling=SamplingParams(0.0, 1.0, 0))
        engine.add(seq)
        seqs.append(seq)
    first: dict[int, float] = {}
    while any(len(s.generated) < max_tokens for s in seqs):
        for seq in engine.step():
            first.setdefault(id(seq), time.monotonic() - started)
        engine.remove({id(s) for s in seqs if len(s.generated) >= max_tokens})
    wall = time.monotonic() - started
    ttfts = sorted(first.values())
    return {"tokens_per_s": concurrency * max_tokens / wall, "ttft_median_ms": 1000 * ttfts[len(ttfts) // 2]}


async def over_http(url: str, concurrency: int, max_tokens: int, *, stream: bool) -> dict[str, float]:
    """`concurrency` concurrent completions; TTFT from the first streamed text (whole reply when not streamed)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=1200, max_retries=0)

    async def one(i: int) -> tuple[float, int]:
        started = time.monotonic()
        if not stream:
            async with httpx.AsyncClient(timeout=1200) as http:
                body = (await http.post(url + "/v1/completions", json={"prompt": PROMPT.format(i=i),
                                                                       "max_tokens": max_tokens})).json()
            return time.monotonic() - started, int(body["usage"]["completion_tokens"])
        first, tokens = None, 0
        async for chunk in await client.completions.create(
                model="smollm2", prompt=PROMPT.format(i=i), max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.monotonic() - started
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first or 0.0, tokens

    started = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.monotonic() - started
    await client.close()
    ttfts = sorted(r[0] for r in results)
    return {"tokens_per_s": sum(r[1] for r in results) / wall, "ttft_median_ms": 1000 * ttfts[len(ttfts) // 2]}


async def vramguard_points(concurrencies: list[int], max_tokens: int) -> dict[str, dict[str, float]]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import RedisServer, Stack

    redis = RedisServer()
    redis.start()
    folder = ROOT / "bench" / "results" / "generate-logs"
    folder.mkdir(parents=True, exist_ok=True)
    stack = Stack(redis.url, folder, served_models="smollm2", model="smollm2", torch_threads=1, key_prefix="bench",
                  memory_planner="false", models__smollm2__params=json.dumps({"chunk_ms": 20}))
    try:
        stack.start_gateway()
        stack.start_worker()
        await stack.wait_ready(600)
        await over_http(stack.url, 1, 2, stream=True)  # warm
        return {str(c): await over_http(stack.url, c, max_tokens, stream=True) for c in concurrencies}
    finally:
        stack.stop()
        redis.stop()


async def naive_points(concurrencies: list[int], max_tokens: int) -> dict[str, dict[str, float]]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import free_port

    port = free_port()
    env = {**os.environ, "BENCH_PORT": str(port), "BENCH_TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.peers.naive_generate"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
        return {str(c): await over_http(url, c, max_tokens, stream=False) for c in concurrencies}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrencies", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    results = {"max_tokens": args.max_tokens,
               "in_process": {str(c): in_process(c, args.max_tokens) for c in concurrencies},
               "vramguard": asyncio.run(vramguard_points(concurrencies, args.max_tokens)),
               "naive": asyncio.run(naive_points(concurrencies, args.max_tokens))}
    top = str(max(concurrencies))
    results["ratios_at_max_concurrency"] = {
        "vramguard_over_naive": results["vramguard"][top]["tokens_per_s"] / results["naive"][top]["tokens_per_s"],
        "vramguard_over_in_process": results["vramguard"][top]["tokens_per_s"]
        / results["in_process"][top]["tokens_per_s"],
    }
    out = ROOT / "bench" / "results" / "generate.json"
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
