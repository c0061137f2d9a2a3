"""Placement on a simulated multi-GPU host: real `python -m vramguard.worker` processes pinned by
CUDA_VISIBLE_DEVICES to simulated GPUs that they share through the device ledger
(worker/memory/ledger.py), so each sees its neighbours' memory and an over-committing allocation fails
as it would on a real GPU."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack, wait_until
from vramguard.worker.memory.ledger import DeviceLedger

MIB = 1024 * 1024
SIM_BYTES = 512 * MIB
WATERMARK = 0.8
# Per worker on the simulated device: 64 MiB of weights; per forward 8 MiB + 4 MiB per item.
PARAMS = json.dumps({"batch_ms": 5, "item_ms": 0.2, "weights_mib": 64, "fixed_mib": 8, "item_mib": 4})


def expected_batch(share: float, inflight: int = 1) -> int:
    """worker/memory/plan.py's arithmetic for PARAMS, written out: floor((share x total - outside the
    allocator - weights) / K - fixed) / per_item), capped at synthetic's max_batch_size of 64. The
    simulated device's context (8 MiB) and kernel modules (4 MiB) are the memory outside the allocator."""
    per_forward_mib = (share * SIM_BYTES / MIB - 12 - 64) / inflight - 8
    return min(64, math.floor(per_forward_mib / 4))


def start_placed(stack: Stack, ledger: Path, gpu: str, workers_on_gpu: int, **extra: object) -> None:
    stack.start_worker({"CUDA_VISIBLE_DEVICES": gpu}, model="synthetic", device="sim", sim_memory_bytes=SIM_BYTES,
                       device_ledger_dir=ledger, workers_per_gpu=workers_on_gpu,
                       models__synthetic__params=PARAMS, **extra)


async def live_beats(client: httpx.AsyncClient) -> dict[str, dict[str, object]]:
    return (await client.get("/v1/models/synthetic")).json()["workers"]  # type: ignore[no-any-return]


async def closed_loop(url: str, clients: int, duration_s: float) -> Counter[int]:
    """`clients` concurrent callers, each sending one request after the other for `duration_s`;
    the count of each status (-1 for a transport error)."""
    statuses: Counter[int] = Counter()
    until = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def caller(n: int) -> None:
            i = 0
            while time.monotonic() < until:
                i += 1
                try:
                    response = await client.post("/v1/models/synthetic/infer", json={"inputs": [n, i]})
                    statuses[response.status_code] += 1
                    if response.status_code == 200:
                        assert response.json()["outputs"] == [n, i]
                except httpx.HTTPError:
                    statuses[-1] += 1

        await asyncio.gather(*(caller(n) for n in range(clients)))
    return statuses


async def _count_live(client: httpx.AsyncClient, n: int) -> bool:
    try:
        return len(await live_beats(client)) >= n
    except httpx.HTTPError:
        return False


@pytest.mark.slow
async def test_workers_started_together_in_reverse_order_get_the_same_plans(stack: Stack, tmp_path: Path) -> None:
    """1. Two simulated GPUs: 3 workers pinned to GPU 0 and 2 to GPU 1, all five started at once,
       GPU 1's first (test_make_up_gpus.py runs the same placement under load through make up).
    Result: every worker on a GPU has the plan its share gives, whatever the start order."""
    ledger = tmp_path / "ledger"
    stack.start_gateway(served_models="synthetic")
    for gpu, n in [("1", 2)] * 2 + [("0", 3)] * 3:
        start_placed(stack, ledger, gpu, n)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        await wait_until(lambda: _count_live(client, 5), 120, interval_s=0.2)
        beats = await live_beats(client)
    plans = {(b["gpu"], b["plan_batch_size"], round(b["memory_share"], 6)) for b in beats.values()}  # type: ignore[arg-type]
    assert plans == {("0", expected_batch(WATERMARK / 3), round(WATERMARK / 3, 6)),
                     ("1", expected_batch(WATERMARK / 2), round(WATERMARK / 2, 6))}, plans


@pytest.mark.slow
async def test_three_workers_each_claiming_the_whole_gpu_cannot_over_commit_it(stack: Stack, tmp_path: Path) -> None:
    """The old way: 3 workers on one simulated GPU with no per-GPU setting, so each asks for the
    whole watermark (0.8) as its share.
    Result: the first one to register serves; the other two refuse to start (exit code 3) with a
    message naming the GPU and the shares, and the shares registered on the GPU add up to at most
    the watermark."""
    ledger = tmp_path / "ledger"
    stack.start_gateway(served_models="synthetic")
    for _ in range(3):
        start_placed(stack, ledger, "0", 1)
    await wait_until(lambda: sum(p.poll() is not None for p in stack.workers) >= 2, 90, interval_s=0.2)
    await asyncio.sleep(2)  # the third must still be serving, not on its way out
    codes = [proc.poll() for proc in stack.workers]
    assert sorted(codes, key=str) == [3, 3, None], (codes, stack.logs())
    logs = stack.logs(tail_lines=200)
    assert logs.count("GPU sim-0: this worker's memory share 0.8 plus the 0.8") == 2, logs
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        await wait_until(lambda: _count_live(client, 1), 60, interval_s=0.2)
    with DeviceLedger(ledger, "sim-0").update() as record:  # as workers read it: exited processes dropped
        shares = [p.get("share") for p in record["processes"].values()]
    assert shares == [WATERMARK]


@pytest.mark.slow
async def test_two_forwards_in_flight_run_without_oom(stack: Stack, tmp_path: Path) -> None:
    """1. One worker on a 256 MiB simulated GPU with max_inflight_batches=2: the plan gives each
       of the two concurrent forwards its own room ((0.8 x 256 - 12 - 64) / 2 - 8) / 4 = 14 items).
    2. 100 concurrent clients for 5 s, each forward taking 20 ms.
    Result: two forwards did run at once, each at most the planned 15 items, and none hit out of
    memory. (The simulated device raises at the budget's limit, so it is the absence of OOM that
    shows the plan's room held, not the peak, which cannot pass the limit.)"""
    stack.start_gateway(served_models="synthetic")
    stack.start_worker(model="synthetic", device="sim", sim_memory_bytes=256 * MIB,
                       models__synthetic__max_inflight_batches=2, models__synthetic__max_wait_ms=2,
                       models__synthetic__params=json.dumps({"batch_ms": 20, "weights_mib": 64, "fixed_mib": 8,
                                                             "item_mib": 4}))
    await stack.wait_ready()
    statuses = await closed_loop(stack.url, 100, 5.0)
    assert set(statuses) == {200}, (statuses, stack.logs())
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:

        async def counted() -> bool:  # the heartbeat the gateway last read has counted every request
            (beat,) = (await live_beats(client)).values()
            return int(beat["requests"]) >= statuses[200]  # type: ignore[call-overload]

        await wait_until(counted, 10)
        (beat,) = (await live_beats(client)).values()
    assert beat["plan_inflight_batches"] == 2 and beat["plan_batch_size"] == 14
    assert beat["max_concurrent_forwards"] == 2 and beat["oom_events"] == 0
    assert beat["mem_peak_bytes"] <= beat["mem_budget_bytes"]  # type: ignore[operator]
    assert beat["largest_forward"] <= 14  # type: ignore[operator]
    assert beat["mem_max_reserved_bytes"] <= beat["mem_cap_bytes"]  # type: ignore[operator]
