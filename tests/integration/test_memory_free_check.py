"""The free-memory check at a worker's start (worker/memory/freemem.py): a GPU that another tenant
already uses is not an empty GPU, whatever the ledger of shares says."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, wait_until
from tests.memwatch import GpuWatch
from vramguard.worker.memory.ledger import DeviceLedger
from vramguard.worker.models import create_backend
from vramguard.worker.runner import ExitCode, Worker

MIB = 1024 * 1024
SIM_BYTES = 512 * MIB
TENANT = """
import sys
from pathlib import Path
from vramguard.worker.memory import simdevice
from vramguard.worker.memory.ledger import DeviceLedger
device = simdevice.configure(int(sys.argv[2]), DeviceLedger(Path(sys.argv[1]), "sim-0"))
device.allocate(int(sys.argv[3]))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def tenant(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that is no vramguard worker (it registers no share) holding 60 % of simulated
    GPU 0 before any worker starts."""
    proc = subprocess.Popen([sys.executable, "-c", TENANT, str(tmp_path / "ledger"), str(SIM_BYTES),
                             str(int(0.6 * SIM_BYTES))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.communicate()


async def test_a_gpu_held_by_another_tenant_is_refused_naming_it(settings_factory, tmp_path: Path,
                                                                 tenant: subprocess.Popen[str],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """1. A tenant holds 60 % of a 512 MiB simulated GPU; the ledger has no share registered.
    2. A worker with the default share (0.8) starts on that GPU.
    Result: it exits STARTUP_FAILED (the placement error code) before loading anything, and its log
    names the GPU, what is free, what it needs and the tenant's PID and memory."""
    settings = settings_factory(model="synthetic", device="sim", sim_memory_bytes=SIM_BYTES,
                                cuda_visible_devices="0", device_ledger_dir=str(tmp_path / "ledger"))
    worker = Worker(settings, create_backend(settings, "sim"))
    with caplog.at_level(logging.ERROR, logger="vramguard.worker.runner"):
        assert await worker.run() == ExitCode.STARTUP_FAILED
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    error = str(record.__dict__["error"])
    assert "GPU SIM-0 (CUDA_VISIBLE_DEVICES=0) has 204 MiB free for this worker of 512 MiB" in error, error
    assert "its memory share 0.8 needs 410 MiB" in error and f"pid {tenant.pid}: 308 MiB" in error, error
    assert "VRAMGUARD_MEMORY_CHECK=warn" in error
    with DeviceLedger(tmp_path / "ledger", "sim-0").update() as ledger:  # the refused worker left no share
        assert [p.get("share") for p in ledger["processes"].values() if p["pid"] != tenant.pid] == []


async def test_with_the_warning_setting_the_worker_plans_on_what_is_free(settings_factory, tmp_path: Path,
                                                                          tenant: subprocess.Popen[str],
                                                                          start_worker,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """1. The same tenant; the worker starts with memory_check=warn.
    Result: it starts, says so loudly, and plans on the 40 % that is free: its budget and its cap
    fit what the tenant left, and tenant + worker never pass the GPU's total."""
    with caplog.at_level(logging.WARNING, logger="vramguard.worker.memory.freemem"):
        handle = await start_worker(device="sim", sim_memory_bytes=SIM_BYTES, cuda_visible_devices="0",
                                    device_ledger_dir=str(tmp_path / "ledger"), memory_check="warn")
    assert any("planning on what is free" in r.getMessage() for r in caplog.records)
    plan = handle.worker.budget.plan
    free_for_worker = SIM_BYTES - 308 * MIB  # the tenant's 307.2 MiB take a segment rounded up to 2 MiB
    assert plan.memory_share == pytest.approx(free_for_worker / SIM_BYTES, abs=1e-6)
    assert plan.budget_bytes <= free_for_worker and plan.planned_batch_size >= 1
    device = handle.worker.budget.accounting.device
    assert device.memory_reserved() + device.outside_bytes <= plan.budget_bytes
    free, total = device.mem_get_info()
    assert free >= 0 and total == SIM_BYTES


@pytest.mark.slow
async def test_shares_are_promises_the_third_worker_beside_a_tenant_is_refused(stack, tmp_path: Path) -> None:
    """1. A tenant outside the ledger holds half of a 1000 MiB simulated GPU.
    2. Two synthetic workers of share 0.24 start on it one after the other and serve; each holds
       less than its share (its weights and cache, not its largest forwards yet).
    3. A third worker of share 0.12 starts: the ledger's shares (0.6) allow it, and what is free
       alone would cover its 120 MiB, but not beside the 480 MiB promised to the two.
    Result: the two serve with 0 OOM events and the GPU never over its total; the third exits
    STARTUP_FAILED naming what is free, what the two are promised and do not hold yet, and what it
    needs, in bytes, with free >= needed > free - promised."""
    total = 1000 * MIB
    ledger = tmp_path / "ledger"
    tenant = subprocess.Popen([sys.executable, "-c", TENANT, str(ledger), str(total), str(total // 2)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert tenant.stdout is not None and tenant.stdout.readline().strip() == "ready"
        common = dict(model="synthetic", device="sim", sim_memory_bytes=total, device_ledger_dir=ledger,
                      memory_share=0.24, environ={"CUDA_VISIBLE_DEVICES": "0"})
        stack.start_gateway(served_models="synthetic")
        with GpuWatch(ledger, "sim-0") as watch:
            async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
                for index in range(2):
                    stack.start_worker(**common)  # type: ignore[arg-type]
                    await stack.wait_ready(120)
                    async def live(n: int = index + 1) -> bool:
                        return await _live(client) == n

                    await wait_until(live, 60)
                    for value in range(20):
                        response = await client.post("/v1/models/synthetic/infer", json={"inputs": [value]})
                        assert response.status_code == 200, response.text
                third = stack.start_worker(**{**common, "memory_share": 0.12})  # type: ignore[arg-type]
                assert await asyncio.to_thread(third.wait, 120) == ExitCode.STARTUP_FAILED
        log = (tmp_path / "worker-2.log").read_text()
        free, promised, needed = (int(re.search(rf"\({name} (\d+) bytes\)", log).group(1))  # type: ignore[union-attr]
                                  for name in ("free", "promised", "needed"))
        assert needed == int(0.12 * total) and free >= needed > free - promised > 0, log[-2000:]
        worker_logs = (tmp_path / "worker-0.log").read_text() + (tmp_path / "worker-1.log").read_text()
        assert sum(int(n) for n in re.findall(r'"oom_events": (\d+)', worker_logs)) == 0
        assert 0 < watch.max_used_bytes <= total and watch.max_over_cap_bytes <= 0, watch.summary()
    finally:
        tenant.kill()
        tenant.communicate()


async def _live(client: httpx.AsyncClient) -> int:
    """Live workers of the synthetic model, as the gateway counts them (0 when it cannot tell)."""
    try:
        return int((await client.get("/v1/models/synthetic")).json()["live_workers"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0
