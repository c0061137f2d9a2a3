"""A real efficientnet worker at a tight share of a simulated GPU, fed batches whose sizes go up and
down: the plan and the soft guard count what the caching allocator keeps reserved between forwards
(weights' segments, cuBLAS's workspace, cached segments of the last batch), not only live tensors,
so no batch runs the GPU out of memory."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Stack
from tests.integration.test_memory_placements_real import PNG, oom_events

MIB = 1024 * 1024
SIM_BYTES = 1536 * MIB
SHARE = 0.100231  # budget 154 MiB: weights, workspace and context leave room for a few items
# Requests sent at once, one burst after the other: each burst is one batch (the batch window is
# longer than sending a burst takes), a large one followed by a slightly smaller one.
BURSTS = [7, 6, 3, 3, 7, 6, 5, 1, 7, 6]


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_efficientnet_at_a_tight_share_serves_batches_of_varying_size_without_oom(stack: Stack,
                                                                                         tmp_path: Path) -> None:
    """1. One efficientnet worker on a 1.5 GiB simulated GPU at a share of 0.100231 (154 MiB),
       max_batch_size 8; its allocations are the real model's, mirrored.
    2. Bursts of 7, 6, 3, 3, 7, 6, 5, 1, 7, 6 concurrent requests, one burst after the other.
    Result: every request answered with 5 labels, batches of more than one size ran, 0 OOM events,
    and the worker's highest reserved memory stayed within its cap."""
    models = {"served_models": "efficientnet", "models__efficientnet__max_batch_size": 8,
              "models__efficientnet__max_wait_ms": 150, "models__efficientnet__default_timeout_ms": 120_000}
    stack.start_gateway(**models)
    stack.start_worker({"CUDA_VISIBLE_DEVICES": "0"}, model="efficientnet", device="sim", sim_memory_bytes=SIM_BYTES,
                       memory_share=SHARE, device_ledger_dir=str(tmp_path / "ledger"), **models)
    await stack.wait_ready(180)
    async with httpx.AsyncClient(base_url=stack.url, timeout=130) as client:
        for n in BURSTS:
            responses = await asyncio.gather(*(client.post("/v1/models/efficientnet/infer", json={"inputs": [PNG]})
                                               for _ in range(n)))
            assert [r.status_code for r in responses] == [200] * n, [r.text[:200] for r in responses]
            assert all(len(r.json()["outputs"][0]["labels"]) == 5 for r in responses)
        await asyncio.sleep(0.5)  # a heartbeat after the last batch
        workers: dict[str, Any] = (await client.get("/v1/models/efficientnet")).json()["workers"]
    beat = next(iter(workers.values()))
    logs = "".join(path.read_text() for path in tmp_path.glob("worker-*.log"))
    sizes = [json.loads(line)["batch_size"] for line in logs.splitlines()
             if re.search(r'"message": "batch done"', line)]
    print(f"[tight share] batches {sizes}, plan {beat['plan_batch_size']} items, max reserved "
          f"{beat['mem_max_reserved_bytes'] / MIB:.1f} of cap {beat['mem_cap_bytes'] / MIB:.1f} MiB, "
          f"OOM {oom_events(logs)}")
    assert len(set(sizes)) > 1, sizes
    assert oom_events(logs) == 0 and beat["oom_events"] == 0
    assert beat["mem_max_reserved_bytes"] <= beat["mem_cap_bytes"]
