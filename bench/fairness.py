"""Fairness under mixed load: the p99 of 1-input requests from one closed-loop client, alone and
then beside BULK_CLIENTS clients sending BULK_INPUTS-input requests, against the target

    p99 mixed <= p99 alone + one full-batch forward + max_wait_ms

with the full-batch forward measured in the same run (the worker's mean forward duration over
the mixed point, from the gateway's /metrics, where nearly every forward is full).

The model is `synthetic` with a fixed forward time (FORWARD_MS whatever the batch size, a sleep:
no CPU), as a GPU forward is nearly flat in batch size up to saturation; on this 2-core machine
a real model would measure the CPU's contention rather than the batching.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import run_point
from bench.stats import summarize
from vramguard.shared.metrics import FORWARD_DURATION, PREFIX

FORWARDS = PREFIX + "worker_forwards"

FORWARD_MS = 40.0
MAX_BATCH_SIZE = 32
MAX_WAIT_MS = 5.0
BULK_CLIENTS = 4
BULK_INPUTS = 256  # 8 full forwards per bulk request


def fairness(cfg: object) -> Iterator[dict[str, object]]:
    """1-input p99 alone, then beside 4 clients of 256-input requests, with the verdict."""
    from bench.services import VramguardService
    from bench.suites import BenchConfig, measure

    assert isinstance(cfg, BenchConfig)
    config = f"synthetic {FORWARD_MS:g} ms forward, batch {MAX_BATCH_SIZE}, window {MAX_WAIT_MS:g} ms"
    settings: dict[str, object] = {
        "torch_threads": 1, "models__synthetic__max_batch_size": MAX_BATCH_SIZE,
        "models__synthetic__max_wait_ms": MAX_WAIT_MS,
        "models__synthetic__params": json.dumps({"batch_ms": FORWARD_MS, "item_ms": 0.0}),
    }
    service = VramguardService("fairness", "synthetic", 1, settings, cfg.log_dir / "fairness")
    service.start()
    assert service.stack is not None
    try:
        alone = measure(service, cfg, 1, bodies=lambda: {"inputs": [0.5]}, suite="fairness", config=config,
                        point="1-input alone")
        yield alone
        before = forward_totals(service.stack.url)
        small, bulk = asyncio.run(mixed(service.infer_url, cfg))
        time.sleep(1.0)  # heartbeats every 250 ms in the bench stack: let the last forwards show
        after = forward_totals(service.stack.url)
        forwards = after[1] - before[1]
        full_forward_ms = 1000 * (after[0] - before[0]) / forwards if forwards else float("nan")
        bound = float(alone["p99_ms"]) + full_forward_ms + MAX_WAIT_MS  # type: ignore[arg-type]
        yield {"suite": "fairness", "config": config, "point": f"1-input beside {BULK_CLIENTS} x {BULK_INPUTS}",
               "system": service.kind, **small, "bulk": bulk, "p99_alone_ms": alone["p99_ms"],
               "full_forward_ms": round(full_forward_ms, 2), "forwards": int(forwards), "max_wait_ms": MAX_WAIT_MS,
               "bound_ms": round(bound, 2), "met": float(small["p99_ms"]) <= bound}  # type: ignore[arg-type]
    finally:
        service.stop()


async def mixed(url: str, cfg: object) -> tuple[dict[str, object], dict[str, object]]:
    """One 1-input client and BULK_CLIENTS bulk clients over the same window; their summaries."""
    duration_s, warmup_s, progress = cfg.duration_s, cfg.warmup_s, cfg.progress  # type: ignore[attr-defined]
    bulk_body: Callable[[], dict[str, object]] = lambda: {"inputs": [0.25] * BULK_INPUTS}  # noqa: E731
    small_run, bulk_run = await asyncio.gather(
        run_point(url, lambda: {"inputs": [0.5]}, concurrency=1, duration_s=duration_s, warmup_s=warmup_s,
                  label="fairness small", progress=progress),
        run_point(url, bulk_body, concurrency=BULK_CLIENTS, duration_s=duration_s, warmup_s=warmup_s,
                  label="fairness bulk", progress=False),
    )
    bulk = summarize(bulk_run, items_per_request=BULK_INPUTS)
    return summarize(small_run), {k: bulk[k] for k in ("requests", "ok", "errors", "items_per_s", "p50_ms", "p99_ms")}


def forward_totals(base_url: str) -> tuple[float, float]:
    """(seconds in run_batch, forwards run) of all workers, from the gateway's /metrics. A batch
    may run several forwards (a request larger than the batch, before slicing), so the time is
    divided by the forward counter, not by the histogram's count of batches."""
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    seconds = forwards = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == FORWARD_DURATION + "_sum":
                seconds += sample.value
            elif sample.name in (FORWARDS, FORWARDS + "_total"):
                forwards += sample.value
    return seconds, forwards
