"""The generation suite (`python -m bench generate`, part of `python -m bench all`): SmolLM2-135M
on the CPU, one torch thread for the model everywhere; tokens/s and median time to first token
at concurrency 1, 8 and 32 for

- in-process: the worker's own engine (worker/generate/engine.py) run directly, all sequences
  admitted at once, no HTTP and no Redis (the model's batched decode limit on this code path);
- vramguard: gateway + Redis + one worker, streamed OpenAI completions (openai's async client);
- naive: a FastAPI endpoint running `generate` per request (bench/peers/naive_generate.py), not
  streamed, so its time to first token is the whole reply's;
- litserve: LitServe streaming (`stream=True`, bench/peers/litserve_generate.py), the same engine
  for one sequence per request.

Every request asks for `max_tokens` tokens, greedy; every system stops a sequence at the model's end
token as the worker does, so all four generate the same tokens (the `tokens` of a point, which the
report shows side by side) and tokens/s counts what was generated. The four are measured
in turn, round by round, each started for its own points and stopped after them (in-process runs in
a process of its own). `python -m bench.generate --in-process` is that process: JSON on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai

from bench.peers.greedy import done_after
from bench.services import PEER_PYTHON, ProcessService, VramguardService

if TYPE_CHECKING:
    from bench.suites import BenchConfig

ROOT = Path(__file__).resolve().parent.parent
# Greedy continuations of these run past 16 tokens for i < 32 (checked in process): every system
# generates the whole max_tokens, so batches do not shrink early.
PROMPT = "Once upon a time, in a village called {i}, there lived"
CONCURRENCIES = (1, 8, 32)
MAX_TOKENS = 16
MAX_ROUNDS = 2  # rounds of the four systems: the whole suite stays within a few minutes on 2 cores
THREADS = 1  # the model's torch threads in every system: the other core is left to servers and client
Point = dict[str, float]


def load_backend() -> Any:
    """SmolLM2's CausalLMBackend, loaded on the CPU with THREADS torch threads."""
    import torch

    from vramguard.shared.settings import Settings
    from vramguard.worker.generate.causal_lm import CausalLMBackend

    torch.set_num_threads(THREADS)
    settings = Settings(model="smollm2", served_models=["smollm2"])
    backend = CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)
    backend.load()
    return backend


def in_process(backend: Any, concurrency: int, max_tokens: int) -> Point:
    """The engine alone: `concurrency` sequences join at once and run `max_tokens` steps.
    Returns tokens_per_s (all sequences' tokens over the wall time) and ttft_median_ms."""
    from vramguard.worker.generate.engine import Engine
    from vramguard.worker.generate.sampling import SamplingParams
    from vramguard.worker.generate.sequence import Sequence

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
    live = {id(s): s for s in seqs}
    while live:
        for seq in engine.step():
            first.setdefault(id(seq), time.monotonic() - started)
        done = {key for key, s in live.items() if done_after(s.generated, max_tokens, backend.eos_token_ids)}
        engine.remove(done)
        live = {key: s for key, s in live.items() if key not in done}
    wall = time.monotonic() - started
    return point(sum(len(s.generated) for s in seqs), wall, list(first.values()))


def point(tokens: int, wall_s: float, ttfts_s: list[float]) -> Point:
    """tokens_per_s, ttft_median_ms (the upper median) and tokens of one load point."""
    ttfts = sorted(ttfts_s)
    return {"tokens_per_s": round(tokens / wall_s, 2), "ttft_median_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
            "tokens": tokens}


async def concurrent(one: Callable[[int], Awaitable[tuple[float, int]]], concurrency: int,
                     max_tokens: int) -> Point:
    """`concurrency` requests at once; `one(i)` returns (time to first token s, tokens received).
    Raises RuntimeError when a reply holds no token or more than `max_tokens` (a server that failed)."""
    started = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    if wrong := [r[1] for r in results if not 1 <= r[1] <= max_tokens]:
        raise RuntimeError(f"{len(wrong)} of {concurrency} replies held {wrong[:4]} tokens (1 to {max_tokens} asked)")
    return point(sum(r[1] for r in results), time.monotonic() - started, [r[0] for r in results])


async def openai_stream(url: str, concurrency: int, max_tokens: int) -> Point:
    """Streamed completions through openai's client; TTFT at the first chunk with text."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=1200, max_retries=0)

    async def one(i: int) -> tuple[float, int]:
        started, first, tokens = time.monotonic(), None, 0
        async for chunk in await client.completions.create(
                model="smollm2", prompt=PROMPT.format(i=i), max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.monotonic() - started
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first or 0.0, tokens

    try:
        return await concurrent(one, concurrency, max_tokens)
    finally:
        await client.close()


async def whole_reply(url: str, concurrency: int, max_tokens: int) -> Point:
    """Non-streamed completions (the naive endpoint); TTFT is the whole reply's time."""
    async with httpx.AsyncClient(timeout=1200) as http:
        async def one(i: int) -> tuple[float, int]:
            started = time.monotonic()
            reply = await http.post(url + "/v1/completions", json={"prompt": PROMPT.format(i=i),
                                                                   "max_tokens": max_tokens})
            return time.monotonic() - started, int(reply.raise_for_status().json()["usage"]["completion_tokens"])

        return await concurrent(one, concurrency, max_tokens)


async def litserve_stream(url: str, concurrency: int, max_tokens: int) -> Point:
    """LitServe's streamed /predict: one JSON line per token; TTFT at the first line."""
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=None)) as http:
        async def one(i: int) -> tuple[float, int]:
            started, first, tokens = time.monotonic(), None, 0
            body = {"prompt": PROMPT.format(i=i), "max_tokens": max_tokens}
            async with http.stream("POST", url + "/predict", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if line.strip():
                        first = time.monotonic() - started if first is None else first
                        tokens += 1
            return first or 0.0, tokens

        return await concurrent(one, concurrency, max_tokens)


def in_process_points(concurrencies: tuple[int, ...], max_tokens: int) -> dict[int, Point]:
    """The in-process points, measured in a process of their own (its model and threads gone after)."""
    argv = [sys.executable, "-m", "bench.generate", "--in-process", "--concurrencies",
            ",".join(map(str, concurrencies)), "--max-tokens", str(max_tokens)]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {int(k): v for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


def served_points(service: ProcessService | VramguardService,
                  client: Callable[[str, int, int], Coroutine[object, object, Point]],
                  concurrencies: tuple[int, ...], max_tokens: int) -> dict[int, Point]:
    """Start `service`, warm it with one 2-token request, measure each concurrency, stop it."""
    service.start()
    try:
        if isinstance(service, VramguardService):
            assert service.stack is not None
            url = service.stack.url
        else:
            url = service.infer_url.removesuffix(service.path)
        asyncio.run(client(url, 1, 2))
        return {c: asyncio.run(client(url, c, max_tokens)) for c in concurrencies}
    finally:
        service.stop()


def systems(cfg: BenchConfig) -> list[tuple[str, Callable[[], dict[int, Point]]]]:
    """(name, measure every concurrency) for the four systems, in the order of each round."""
    logs = cfg.log_dir / "generate"
    vramguard = VramguardService("generate-vramguard", "smollm2", 1, {
        "torch_threads": THREADS, "memory_planner": "false",
        "models__smollm2__params": json.dumps({"chunk_ms": 20})}, logs / "vramguard")
    naive = ProcessService("naive-generate", [sys.executable, "-m", "bench.peers.naive_generate"], logs,
                           path="/v1/completions", env={"BENCH_TORCH_THREADS": str(THREADS)}, kind="naive")
    litserve = ProcessService("litserve-generate", [str(PEER_PYTHON), "-m", "bench.peers.litserve_generate"], logs,
                              env={"BENCH_TORCH_THREADS": str(THREADS)})
    c, n = CONCURRENCIES, MAX_TOKENS
    return [("in-process", lambda: in_process_points(c, n)),
            ("vramguard", lambda: served_points(vramguard, openai_stream, c, n)),
            ("naive", lambda: served_points(naive, whole_reply, c, n)),
            ("litserve", lambda: served_points(litserve, litserve_stream, c, n))]


def generate(cfg: BenchConfig) -> Iterator[dict[str, object]]:
    """The four systems in turn for min(cfg.pairs, MAX_ROUNDS) rounds: one record per point."""
    if not PEER_PYTHON.exists():
        raise RuntimeError(f"no peer venv at {PEER_PYTHON.parent.parent}: `make bench` builds it")
    for round_ in range(min(cfg.pairs, MAX_ROUNDS)):
        for name, measure in systems(cfg):
            print(f"generate round {round_}: {name}", file=sys.stderr, flush=True)
            for concurrency, figures in measure().items():
                yield {"suite": "generate", "config": name, "pair": round_, "concurrency": concurrency,
                       "max_tokens": MAX_TOKENS, "torch_threads": THREADS, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-process", action="store_true", required=True,
                        help="measure the engine in this process, one JSON object on stdout (the suite runs this; "
                             "the whole suite is `python -m bench generate`)")
    parser.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args()
    backend = load_backend()
    in_process(backend, 1, 2)  # warm, as the served systems are
    points = {c: in_process(backend, int(c), args.max_tokens) for c in args.concurrencies.split(",")}
    print(json.dumps(points))


if __name__ == "__main__":
    main()
