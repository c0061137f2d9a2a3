"""The cap before the first byte, with real worker processes on one tight simulated GPU: a worker
that restarts again and again next to a busy neighbour never reserves more than its cap, so the
neighbour never runs out of memory inside its own share."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.chaos.load import Load, Tally
from tests.helpers import Stack, wait_until
from tests.memwatch import GpuWatch

MIB = 1024 * 1024
SIM_BYTES = 512 * MIB
# Per worker: 128 MiB of weights, a forward 16 MiB + 30 MiB per item. Measuring 1, 2, 4 and 8 items
# (46 to 256 MiB) takes more than a share of 0.4 (204.8 MiB) holds next to the weights.
PARAMS = json.dumps({"batch_ms": 5, "weights_mib": 128, "fixed_mib": 16, "item_mib": 30})
RESTARTS = 5
CLIENTS = 10


async def beats(client: httpx.AsyncClient) -> dict[str, dict[str, object]]:
    try:
        return (await client.get("/v1/models/synthetic")).json()["workers"]  # type: ignore[no-any-return]
    except httpx.HTTPError:
        return {}


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_worker_restarted_5_times_next_to_a_busy_one_never_takes_its_memory(
    stack: Stack, tmp_path: Path,
) -> None:
    """1. One simulated GPU of 512 MiB; worker A with a share of 0.4 serves 10 closed-loop clients.
    2. Worker B, share 0.4, starts next to it (its measuring grid would need more than its share),
       becomes live and is SIGKILLed, 5 times over, while the load runs.
    3. A watcher reads the GPU's ledger (what NVML would show per process) all along.
    Result: A had 0 OOM events; no request failed; every B kept its reserved memory within its
    cap at every sample; reserved + memory outside the allocator of all processes never passed the
    GPU's total."""
    ledger = tmp_path / "ledger"
    common = dict(model="synthetic", device="sim", sim_memory_bytes=SIM_BYTES, device_ledger_dir=ledger,
                  memory_share=0.4, models__synthetic__params=PARAMS, models__synthetic__max_wait_ms=2)
    stack.start_gateway(served_models="synthetic")
    stack.start_worker({"CUDA_VISIBLE_DEVICES": "0"}, worker_name="worker-a", **common)
    await stack.wait_ready()
    with GpuWatch(ledger, "sim-0") as watch:
        async with Load(stack.url, clients=CLIENTS) as load, \
                httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            done = asyncio.Event()
            traffic = asyncio.create_task(load_until(load, done))
            for i in range(RESTARTS):  # a fresh name each time: the killed one's heartbeat outlives it
                b = stack.start_worker({"CUDA_VISIBLE_DEVICES": "0"}, worker_name=f"worker-b{i}", **common)
                await wait_until(functools.partial(_b_live, client, b, f"worker-b{i}"), 120, interval_s=0.2)
                b.send_signal(signal.SIGKILL)
                b.wait()
            done.set()
            tally = await traffic
            a = (await beats(client))["worker-a"]
    codes = [p.returncode for p in stack.workers[1:]]
    print(f"[restart] B restarted {RESTARTS} times next to A: sent={tally.sent} 200={tally.ok} "
          f"errors={dict(tally.errors)} lost={tally.lost} A oom_events={a['oom_events']} {watch.summary()}")
    assert codes == [-signal.SIGKILL] * RESTARTS, (codes, stack.logs())
    assert int(a["oom_events"]) == 0, stack.logs()
    assert tally.sent > 0 and tally.ok == tally.sent and tally.lost == 0, dict(tally.errors)
    assert watch.samples > 10 * RESTARTS and watch.processes_seen >= RESTARTS + 1
    assert watch.max_used_bytes <= SIM_BYTES, watch.summary()
    assert watch.max_over_cap_bytes <= 0, watch.summary()


async def load_until(load: Load, done: asyncio.Event) -> Tally:
    """The load in short rounds until `done` is set; the tally of all of them."""
    while not done.is_set():
        await load.run_for(0.5)
    return load.tally


async def _b_live(client: httpx.AsyncClient, proc: subprocess.Popen[bytes], name: str) -> bool:
    assert proc.poll() is None, f"worker B exited at start with {proc.returncode}"
    return name in await beats(client)
