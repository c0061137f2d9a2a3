"""The generation suite's mixed workload (bench/generate.py): chat requests whose prompts run from
16 to 1,500 tokens, all sent at once, each ending at the model's own end of turn, and while they run
the server's KV cache and running sequences, sampled every SAMPLE_S.

Prompts: a few short questions, then slices of bench/corpus.txt followed by QUESTION, sized to the
target token counts with the model's own tokenizer and chat template (an empty system message,
else SmolLM2's template adds its default one of about 30 tokens). Greedy SmolLM2-135M answers
each in 14 to about 90 tokens (checked on vLLM at the targets below), so the run is bounded by the
prompts, not by sequences that run to the end of the context window.

`max_tokens`: unset for vLLM (its chat route then generates up to the room left in the window), and
the room left (window - prompt tokens) for vramguard: the bound its worker also takes when max_tokens
is unset, asked for explicitly so that both runs name it.

Samples: for vramguard, each worker's heartbeat (`generation`: `running`, `kv_tokens_held` and the
plan's `tokens_fit`); for vLLM, its /metrics (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, blocks in use over its cache's blocks). A sample counts as saturated
while the client has more requests open than the server runs (the rest wait: in vLLM's queue, or in
vramguard's stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

QUESTION = "Which word appears most often in the text above? Reply with that one word."
SHORT = ("Say hello.", "Name a colour.", "Name a fruit.", "Say thanks.")
SHORTEST_TOKENS, LONGEST_TOKENS = 16, 1500
SAMPLE_S = 0.25  # the workers' heartbeat interval in the suite (VramguardService)


def target_lengths(requests: int, shortest: int = SHORTEST_TOKENS, longest: int = LONGEST_TOKENS) -> list[int]:
    """`requests` prompt sizes in tokens, spaced evenly on a log scale from `shortest` to `longest`
    (many short prompts, a few long ones, as chat traffic runs), long and short interleaved so
    that the longest do not all arrive together."""
    if requests == 1:
        return [shortest]
    sizes = [round(shortest * (longest / shortest) ** (i / (requests - 1))) for i in range(requests)]
    return [sizes[i // 2] if i % 2 == 0 else sizes[-1 - i // 2] for i in range(requests)]


Prompt = tuple[list[dict[str, str]], int]  # chat messages, prompt tokens


def mixed_prompts(folder: Path, requests: int, *, longest: int = LONGEST_TOKENS) -> list[Prompt]:
    """(chat messages, prompt tokens) for each of `requests` prompts (target_lengths), counted with the
    tokenizer and chat template in the model folder `folder`, as the servers count them."""
    from transformers import AutoTokenizer

    from bench.corpus import load_corpus

    tokenizer: Any = AutoTokenizer.from_pretrained(folder)
    corpus_ids = tokenizer(" ".join(load_corpus()), add_special_tokens=False)["input_ids"]

    def count(messages: list[dict[str, str]]) -> int:
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    def chat(content: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": ""}, {"role": "user", "content": content}]

    overhead = count(chat(QUESTION))
    out = []
    for i, size in enumerate(target_lengths(requests, longest=longest)):
        if size <= overhead:
            messages = chat(SHORT[i % len(SHORT)])
        else:  # each prompt its own slice of the corpus: no two share a prefix
            start = (37 * i) % max(1, len(corpus_ids) - size)
            messages = chat(tokenizer.decode(corpus_ids[start : start + size - overhead - 2]) + "\n\n" + QUESTION)
        out.append((messages, count(messages)))
    return out


@dataclass
class Sampler:
    """Polls `read()` -> (running, kv share 0-1) every SAMPLE_S while a workload runs; `in_flight`
    is the client's count of open requests, set by the workload."""

    read: Callable[[], tuple[int, float]]
    in_flight: int = 0
    samples: list[tuple[int, int, float]] = field(default_factory=list)  # (in flight, running, kv share)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                running, share = await asyncio.to_thread(self.read)
                self.samples.append((self.in_flight, running, share))
            except (httpx.HTTPError, KeyError, ValueError, StopIteration):
                pass  # a sample missed (a heartbeat between two writes): the next one counts
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_S)
            except TimeoutError:
                pass

    def summary(self) -> dict[str, object]:
        """Over the saturated samples (more requests open than running): the median KV share
        (kv_share_saturated, 0-1) and the median and most sequences running at once."""
        saturated = [(running, share) for open_, running, share in self.samples if open_ > running]
        if not saturated:
            return {"samples": len(self.samples), "saturated_samples": 0}
        running = [r for r, _ in saturated]
        return {"samples": len(self.samples), "saturated_samples": len(saturated),
                "kv_share_saturated": round(float(np.median([s for _, s in saturated])), 3),
                "running_saturated": float(np.median(running)), "running_max": max(running)}


def vramguard_reader(heartbeats: Callable[[], dict[str, dict[str, object]]]) -> Callable[[], tuple[int, float]]:
    """(running sequences, tokens held / the plan's tokens_fit) summed over the workers' heartbeats."""
    def read() -> tuple[int, float]:
        gens = [w["generation"] for w in heartbeats().values() if isinstance(w.get("generation"), dict)]
        running = sum(int(g["running"]) for g in gens)  # type: ignore[index]
        held = sum(int(g["kv_tokens_held"]) for g in gens)  # type: ignore[index]
        pool = sum(int(g["kv_plan"]["tokens_fit"]) for g in gens)  # type: ignore[index]
        return running, held / pool if pool else 0.0
    return read


def vllm_reader(url: str) -> Callable[[], tuple[int, float]]:
    """(vllm:num_requests_running, vllm:kv_cache_usage_perc) from vLLM's /metrics at `url`."""
    from prometheus_client.parser import text_string_to_metric_families

    def read() -> tuple[int, float]:
        text = httpx.get(url + "/metrics", timeout=5.0).raise_for_status().text
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")}
        return int(values["vllm:num_requests_running"]), float(values["vllm:kv_cache_usage_perc"])
    return read


async def run_mixed(url: str, prompts: list[Prompt], *, window: int | None,
                    sampler: Sampler) -> dict[str, object]:
    """Every prompt at once as a streamed chat completion, greedy; `window`: ask for max_tokens = the
    room left in it (None: leave max_tokens unset). Returns tokens/s, TTFT median and p90 and the
    sampler's summary. Raises RuntimeError when a reply holds no token."""
    from bench.generate import point

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=1800, max_retries=0)

    async def one(messages: list[dict[str, str]], prompt_tokens: int) -> tuple[float, int]:
        extra = {"max_tokens": window - prompt_tokens} if window is not None else {}
        started, first, tokens = time.monotonic(), None, 0
        sampler.in_flight += 1
        try:
            async for chunk in await client.chat.completions.create(
                    model="smollm2", messages=messages, temperature=0, stream=True,  # type: ignore[arg-type]
                    stream_options={"include_usage": True}, **extra):  # type: ignore[call-overload]
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.monotonic() - started
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        finally:
            sampler.in_flight -= 1
        return first or 0.0, tokens

    stop = asyncio.Event()
    polling = asyncio.create_task(sampler.run(stop))
    started = time.monotonic()
    try:
        results = await asyncio.gather(*(one(m, n) for m, n in prompts))
    finally:
        stop.set()
        await polling
        await client.close()
    if empty := sum(1 for r in results if r[1] < 1):
        raise RuntimeError(f"{empty} of {len(prompts)} replies held no token")
    return {**point(sum(r[1] for r in results), time.monotonic() - started, [r[0] for r in results]),
            "requests": len(prompts), "prompt_tokens": sum(n for _, n in prompts),
            "max_tokens": "room left" if window is not None else "unset", **sampler.summary()}


def describe(prompts: list[Prompt]) -> str:
    """One line on a mixed workload's prompt sizes (for logs)."""
    sizes = sorted(n for _, n in prompts)
    return json.dumps({"requests": len(sizes), "prompt_tokens_min": sizes[0], "median": sizes[len(sizes) // 2],
                       "max": sizes[-1], "total": sum(sizes)})
