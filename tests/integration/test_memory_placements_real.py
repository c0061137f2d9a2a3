"""Random placements of the shipped models themselves on simulated GPUs: minilm, efficientnet and
smollm2 run for real on the CPU while the allocation mirror (worker/memory/mirror.py) feeds each
tensor they create and free into the simulated caching allocator, beside the synthetic model.
Whatever the placement and the order in which workers die and restart, no GPU runs out of memory,
no worker reserves more than its cap, and no request fails. The draws are few (each real worker
loads torch and its weights, and measures its forwards, on 2 busy cores); the seed is printed."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.helpers import Stack, wait_until
from tests.integration.test_memory_placements import PlacedSupervisor, kill_each_until_back, live_counts
from tests.memwatch import GpuWatch
from vramguard.cli.placement import Gpu, WorkerGroup

MIB = 1024 * 1024
PLACEMENTS = int(os.environ.get("TEST_REAL_PLACEMENTS", "2"))
FIRST_SEED = int(os.environ.get("TEST_REAL_PLACEMENT_SEED", str(int(time.time()) % 10_000)))
SIM_BYTES = 1536 * MIB
WATERMARK = 0.8
MAX_WORKERS = 3
CLIENTS = 12
BURST_S = 2.0
DEADLINE_MS = 300_000
# The least budget each model is drawn with (bytes): its weights as the mirror counts them (segments
# included), cuBLAS's workspace, the context, and room for a few items. Shares above it stay tight:
# the plan's batch cap binds below max_batch_size.
MIN_BYTES = {"minilm": 190 * MIB, "efficientnet": 110 * MIB, "smollm2": 1000 * MIB, "synthetic": 80 * MIB}
# The synthetic model's declared memory (worker/models/synthetic.py), smaller than its defaults.
SYNTHETIC = json.dumps({"batch_ms": 2, "item_ms": 0.2, "weights_mib": 32, "fixed_mib": 4, "item_mib": 2})
# Smaller batches than the catalogue's: fewer measuring forwards at each (re)start on 2 busy cores.
MAX_BATCH = {"minilm": 8, "efficientnet": 8, "smollm2": 4, "synthetic": 64}
MODELS = tuple(os.environ.get("TEST_REAL_PLACEMENT_MODELS", "minilm,efficientnet,smollm2,synthetic").split(","))


@dataclass(frozen=True)
class Placement:
    seed: int
    groups: list[WorkerGroup]

    @property
    def workers(self) -> int:
        return sum(g.workers for g in self.groups)

    @property
    def models(self) -> list[str]:
        return sorted({g.model for g in self.groups})

    def describe(self) -> str:
        return ", ".join(f"{g.model}x{g.workers}@gpu{g.gpu.index}:{g.share:.3f}" for g in self.groups if g.gpu)


def draw(seed: int) -> Placement:
    """1-2 GPUs, at most MAX_WORKERS workers, each of a random model with a tight share: its model's
    least budget (MIN_BYTES) times 1-1.4; redrawn until the shares of each GPU fit its watermark."""
    rng = random.Random(seed)
    while True:
        counts = [rng.randint(1, 2) for _ in range(rng.randint(1, 2))]
        if sum(counts) > MAX_WORKERS:
            continue
        groups: list[WorkerGroup] = []
        for index, count in enumerate(counts):
            for model in [rng.choice(MODELS) for _ in range(count)]:
                share = int(MIN_BYTES[model] * rng.uniform(1.0, 1.4) / SIM_BYTES * 1e6) / 1e6
                groups.append(WorkerGroup(model=model, gpu=Gpu(index, str(index)), workers=1,
                                          workers_on_device=count, share=share))
        per_gpu = Counter[int]()
        for g in groups:
            per_gpu[g.gpu.index] += g.share  # type: ignore[union-attr,operator]
        if all(total <= WATERMARK for total in per_gpu.values()):
            return Placement(seed, _merged(groups))


def _merged(groups: list[WorkerGroup]) -> list[WorkerGroup]:
    """One group per model and GPU (supervisor names a program per group)."""
    merged: dict[tuple[str, int], WorkerGroup] = {}
    for g in groups:
        assert g.gpu is not None
        key = (g.model, g.gpu.index)
        if key in merged:  # two workers of one model on one GPU: one program of 2, the smaller share each
            old = merged[key]
            merged[key] = WorkerGroup(model=g.model, gpu=g.gpu, workers=old.workers + 1,
                                      workers_on_device=g.workers_on_device, share=min(old.share or 0, g.share or 0))
        else:
            merged[key] = g
    return list(merged.values())


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), (30, 140, 220)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = _png()


async def one_request(client: httpx.AsyncClient, model: str, n: int) -> tuple[bool, str]:
    """One request of `model`'s kind; (ok, why not)."""
    if model == "smollm2":
        response = await client.post("/v1/completions", json={"model": model, "prompt": f"Count {n}", "max_tokens": 4})
        ok = response.status_code == 200 and bool(response.json()["choices"])
    elif model == "efficientnet":
        response = await client.post(f"/v1/models/{model}/infer", json={"inputs": [PNG]})
        ok = response.status_code == 200 and len(response.json()["outputs"][0]["labels"]) == 5
    elif model == "minilm":
        text = " ".join(["word"] * (1 + n % 60)) + f" {n}"
        response = await client.post(f"/v1/models/{model}/infer", json={"inputs": [text]})
        ok = response.status_code == 200 and len(response.json()["outputs"][0]) == 384
    else:
        response = await client.post(f"/v1/models/{model}/infer", json={"inputs": [n]})
        ok = response.status_code == 200 and response.json()["outputs"] == [n]
    return ok, f"{model} {response.status_code} {response.text[:120]}"


async def load_until(url: str, models: list[str], done: asyncio.Event, tally: Counter[str]) -> None:
    """CLIENTS closed loops over the placement's models until `done`; counts sent and failures."""
    values = itertools.count()
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_MS / 1000 + 10) as client:

        async def loop(k: int) -> None:
            for model in itertools.cycle(models[k % len(models):] + models[:k % len(models)]):
                if done.is_set():
                    return
                tally["sent"] += 1
                try:
                    ok, why = await one_request(client, model, next(values))
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                if not ok:
                    tally["failed"] += 1
                    tally[why] += 1

        await asyncio.gather(*(loop(k) for k in range(CLIENTS)))


def oom_events(logs: str) -> int:
    """OOM events while serving: "batch done" lines of the batch server and OOM lines of the generation loop."""
    import re

    batches = sum(int(n) for n in re.findall(r'"message": "batch done".*?"oom_events": (\d+)', logs))
    return batches + len(re.findall(r'"message": "[^"]*out of memory[^"]*"', logs))


def model_settings(models: list[str]) -> dict[str, object]:
    """Per-model settings for the gateway and the workers: a deadline that outlasts restarts,
    MAX_BATCH, and the synthetic model's declared memory (SYNTHETIC)."""
    out: dict[str, object] = {f"models__{m}__default_timeout_ms": DEADLINE_MS for m in models}
    out.update({f"models__{m}__max_batch_size": MAX_BATCH[m] for m in models})
    if "synthetic" in models:
        out["models__synthetic__params"] = SYNTHETIC
    return out


async def run_placement(stack: Stack, placement: Placement, root: Path) -> dict[str, object]:
    """Start every worker, SIGKILL each once in random order under load (supervisord restarts it),
    and run until all are live again. Returns the figures."""
    rng = random.Random(placement.seed)
    run_dir = root / f"real-{placement.seed}"
    ledger = run_dir / "ledger"
    models = placement.models
    expected = Counter({m: sum(g.workers for g in placement.groups if g.model == m) for m in models})
    timeouts = model_settings(models)
    supervisor = PlacedSupervisor(stack, placement, run_dir, device="sim", sim_memory_bytes=SIM_BYTES,  # type: ignore[arg-type]
                                  device_ledger_dir=ledger, watermark=WATERMARK, claim_idle_ms=8000,
                                  reclaim_interval_ms=500, **timeouts)
    watches = [GpuWatch(ledger, f"sim-{i}") for i in sorted({g.gpu.index for g in placement.groups if g.gpu})]
    tally: Counter[str] = Counter()
    done = asyncio.Event()
    try:
        for watch in watches:
            watch.__enter__()
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            async def all_live() -> bool:
                return Counter(await live_counts(client, models)) == expected

            await wait_until(all_live, 600, interval_s=0.5)
            traffic = asyncio.create_task(load_until(stack.url, models, done, tally))
            kills = await kill_each_until_back(supervisor, rng, all_live, (0.5, BURST_S), 600, interval_s=0.5)
            await asyncio.sleep(BURST_S)
            done.set()
            await traffic
    finally:
        done.set()
        supervisor.stop()
        for watch in watches:
            watch.__exit__()
    reserved, cap = max((w.worst_reserved_vs_cap for w in watches), key=lambda rc: rc[0] / max(1, rc[1]))
    return {
        "seed": placement.seed, "placement": placement.describe(), "workers": placement.workers,
        "sent": tally.pop("sent", 0), "failed": tally.pop("failed", 0), "failures": dict(tally),
        "oom_events": oom_events(supervisor.worker_logs()), "kills": kills,
        "max_used_bytes": max(w.max_used_bytes for w in watches),
        "max_over_cap_bytes": max(w.max_over_cap_bytes for w in watches),
        "max_reserved_over_cap": round(reserved / max(1, cap), 3), "samples": sum(w.samples for w in watches),
    }


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_random_placements_of_real_models_never_run_a_gpu_out_of_memory(stack: Stack, tmp_path: Path) -> None:
    """For each of PLACEMENTS random placements (seeds from TEST_REAL_PLACEMENT_SEED, printed; 1-2
    simulated GPUs of 1.5 GiB, 1-3 workers of minilm, efficientnet, smollm2 or synthetic, tight shares):
    1. every worker starts under one supervisord (the shipped configuration), its model on the CPU
       with its allocations mirrored into its simulated GPU;
    2. under 12 concurrent clients, every worker is SIGKILLed once in random order; supervisord
       restarts each; the load runs until all are live again;
    3. a watcher reads each simulated GPU's ledger (per-process used memory, as NVML shows it).
    Result, in every placement: 0 OOM events, 0 failed requests, on each GPU reserved + context +
    modules over its workers <= its total at every sample, and every worker's reserved <= its cap."""
    placements = [draw(FIRST_SEED + i) for i in range(PLACEMENTS)]
    print(f"[real placements] seeds {[p.seed for p in placements]} (TEST_REAL_PLACEMENT_SEED={FIRST_SEED})")
    served = sorted({m for p in placements for m in p.models})
    stack.start_gateway(served_models=",".join(served), worker_return_grace_s=600, **model_settings(served))
    figures = []
    for placement in placements:
        figures.append(await run_placement(stack, placement, tmp_path))
        print(f"[real placements] {figures[-1]}")
    for f in figures:
        assert f["failed"] == 0 and f["oom_events"] == 0, f
        assert int(f["max_used_bytes"]) <= SIM_BYTES and int(f["max_over_cap_bytes"]) <= 0, f  # type: ignore[call-overload]
        assert int(f["sent"]) > 0 and int(f["samples"]) > 0, f  # type: ignore[call-overload]
