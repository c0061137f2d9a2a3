"""The free-memory check at a worker's start (worker/memory/freemem.py): a GPU that another tenant
already uses is not an empty GPU, whatever the ledger of shares says."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT
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
