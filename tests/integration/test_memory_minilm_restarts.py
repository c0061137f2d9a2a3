"""Two minilm workers on one small simulated GPU, killed and restarted again and again under load:
the real model's own allocations (worker/memory/mirror.py) never run the GPU out of memory, and
what they compute is what the CPU worker computes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import Stack, wait_until
from tests.integration.test_memory_placements import PlacedSupervisor, live_counts
from tests.integration.test_memory_placements_real import oom_events
from tests.memwatch import GpuWatch
from vramguard.cli.placement import Gpu, WorkerGroup
from vramguard.shared.settings import Settings
from vramguard.worker.batch.execute import run_batch
from vramguard.worker.models import create_backend

MIB = 1024 * 1024
SIM_BYTES = 512 * MIB
ROUNDS = 3
DEADLINE_MS = 300_000
TEXTS = [" ".join(["token"] * (1 + (7 * i) % 90)) + f" number {i}" for i in range(48)]


def cpu_embeddings() -> dict[str, np.ndarray]:
    """Each text's embedding from minilm on the CPU, one text per forward (no padding)."""
    settings = Settings(model="minilm", device="cpu")
    backend = create_backend(settings, "cpu")
    backend.load()
    out = {}
    for text in TEXTS:
        (result,), _ = run_batch(backend, backend.decode([text], {}), 1)
        out[text] = np.asarray(result.output, dtype=np.float32)
    return out


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_two_minilm_workers_restarted_under_load_never_oom_and_embed_as_the_cpu(stack: Stack,
                                                                                       tmp_path: Path) -> None:
    """1. Two minilm workers, shares 0.4 + 0.4 of a 512 MiB simulated GPU, under one supervisord.
    2. Eight clients send texts of 2-92 words; each worker is SIGKILLed 3 times (both in each round,
       a random moment apart), supervisord restarts it, the next round starts when both are live
       and have answered 16 more requests (a request queued while both restart must get its turn).
    Result: 0 OOM events, the GPU never over its total nor a worker over its cap, every request
    answered, and every embedding equal (to 1e-5) to the CPU worker's for the same text."""
    reference = await asyncio.to_thread(cpu_embeddings)
    seed = int(time.time()) % 10_000
    print(f"[minilm restarts] seed {seed}")
    rng = random.Random(seed)
    stack.start_gateway(served_models="minilm", worker_return_grace_s=600,
                        models__minilm__default_timeout_ms=DEADLINE_MS)
    group = WorkerGroup(model="minilm", gpu=Gpu(0, "0"), workers=2, workers_on_device=2, share=0.4)
    run_dir, ledger = tmp_path / "run", tmp_path / "run" / "ledger"
    placement = type("P", (), {"groups": [group], "workers": 2})()
    supervisor = PlacedSupervisor(stack, placement, run_dir, device="sim", sim_memory_bytes=SIM_BYTES,  # type: ignore[arg-type]
                                  device_ledger_dir=ledger, claim_idle_ms=8000, reclaim_interval_ms=500,
                                  models__minilm__default_timeout_ms=DEADLINE_MS)
    tally: Counter[str] = Counter()
    mismatches: list[tuple[str, float]] = []
    answered = [0]
    done = asyncio.Event()

    async def clients() -> None:
        async with httpx.AsyncClient(base_url=stack.url, timeout=DEADLINE_MS / 1000 + 10) as client:
            async def loop(k: int) -> None:
                i = k
                while not done.is_set():
                    text = TEXTS[i % len(TEXTS)]
                    i += 8
                    tally["sent"] += 1
                    response = await client.post("/v1/models/minilm/infer", json={"inputs": [text]})
                    if response.status_code != 200:
                        tally[f"{response.status_code} {response.text[:100]}"] += 1
                        continue
                    answered[0] += 1
                    got = np.asarray(response.json()["outputs"][0], dtype=np.float32)
                    gap = float(np.abs(got - reference[text]).max())
                    if gap > 1e-5:
                        mismatches.append((text, gap))

            await asyncio.gather(*(loop(k) for k in range(8)))

    with GpuWatch(ledger, "sim-0") as watch:
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
                async def both_live(spawned: int = 1) -> bool:
                    spawns = supervisor.spawns()
                    return len(spawns) == 2 and all(len(p) >= spawned for p in spawns.values()) and \
                        (await live_counts(client, ["minilm"]))["minilm"] == 2

                await wait_until(both_live, 600, interval_s=0.5)
                traffic = asyncio.create_task(clients())
                for round_ in range(ROUNDS):
                    for name in sorted(supervisor.spawns()):
                        await asyncio.sleep(rng.uniform(0, 2))
                        os.kill(supervisor.spawns()[name][-1], signal.SIGKILL)

                    async def back(n: int = round_ + 2) -> bool:
                        return await both_live(n)

                    await wait_until(back, 600, interval_s=0.5)
                    served = answered[0]
                    await wait_until(lambda s=served: answered[0] >= s + 16, 600, interval_s=0.2)  # under load again
                done.set()
                await traffic
        finally:
            done.set()
            supervisor.stop()
    sent = tally.pop("sent", 0)
    print(f"[minilm restarts] sent {sent}, failures {dict(tally)}, mismatches {len(mismatches)}, {watch.summary()}")
    assert sent > 0 and not tally and not mismatches, (tally, mismatches[:3])
    assert oom_events(supervisor.worker_logs()) == 0
    assert 0 < watch.max_used_bytes <= SIM_BYTES and watch.max_over_cap_bytes <= 0, watch.summary()
