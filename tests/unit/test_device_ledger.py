"""The per-device ledger (worker/ledger.py) and the simulated GPU shared through it
(worker/simdevice.py). A neighbour is a real other process: the test's parent process (alive) or
a child that has exited (dead)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from vramguard.worker.ledger import DeviceLedger, PlacementError
from vramguard.worker.simdevice import MIB, SimDevice


def write_neighbour(ledger: DeviceLedger, pid: int, **entry: object) -> None:
    with ledger.update() as record:
        record["processes"][str(pid)] = entry


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_share_that_would_over_commit_the_gpu_is_refused_naming_it(tmp_path: Path) -> None:
    ledger = DeviceLedger(tmp_path, "sim-0")
    write_neighbour(ledger, os.getppid(), share=0.5)
    with pytest.raises(PlacementError, match=r"GPU sim-0: this worker's memory share 0.4 plus the 0.5"):
        ledger.register_share(0.4, watermark=0.8)
    assert ledger.register_share(0.3, watermark=0.8) == pytest.approx(0.5)


def test_shares_of_dead_processes_come_back(tmp_path: Path) -> None:
    ledger = DeviceLedger(tmp_path, "sim-0")
    write_neighbour(ledger, dead_pid(), share=0.8, reserved_bytes=100)
    assert ledger.register_share(0.8, watermark=0.8) == 0
    assert list(json.loads(ledger.path.read_text())["processes"]) == [str(os.getpid())]


def test_neighbours_memory_is_seen_and_the_allocation_crossing_the_total_fails(tmp_path: Path) -> None:
    ledger = DeviceLedger(tmp_path, "sim-0")
    dev = SimDevice(100 * MIB, ledger)
    write_neighbour(ledger, os.getppid(), reserved_bytes=70 * MIB)
    assert dev.mem_get_info() == (30 * MIB, 100 * MIB)
    dev.allocate(20 * MIB)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="70.00 MiB reserved by other processes"):
        dev.allocate(20 * MIB)
    assert dev.memory_allocated() == 20 * MIB  # a failed allocation takes nothing
    assert json.loads(ledger.path.read_text())["processes"][str(os.getpid())]["reserved_bytes"] == 20 * MIB


def test_the_process_drops_its_own_cache_before_reporting_oom(tmp_path: Path) -> None:
    """As the CUDA caching allocator does: cached blocks go back before an allocation fails."""
    ledger = DeviceLedger(tmp_path, "sim-0")
    dev = SimDevice(100 * MIB, ledger)
    with dev.transient(60 * MIB):
        pass
    assert dev.memory_reserved() == 60 * MIB
    write_neighbour(ledger, os.getppid(), reserved_bytes=45 * MIB)
    dev.allocate(50 * MIB)  # 45 + max(60 cached, 50) > 100, but 45 + 50 fits once the cache is dropped
    assert dev.memory_reserved() == 50 * MIB


def test_a_gpu_of_another_size_is_refused(tmp_path: Path) -> None:
    ledger = DeviceLedger(tmp_path, "sim-1")
    write_neighbour(ledger, os.getppid(), reserved_bytes=MIB)
    with ledger.update() as record:
        record["total_bytes"] = 200 * MIB
    with pytest.raises(ValueError, match="VRAMGUARD_SIM_MEMORY_BYTES"):
        SimDevice(100 * MIB, ledger)


def test_concurrent_forwards_are_admitted_only_while_their_peaks_fit(tmp_path: Path) -> None:
    """Four threads each run a forward whose predicted peak is 40 % of the room: the soft guard
    lets at most two run at once, and every one of them runs."""
    from vramguard.shared.models import ModelOverrides
    from vramguard.shared.settings import Settings
    from vramguard.worker.memory import start_budget
    from vramguard.worker.models.synthetic import SyntheticBackend

    settings = Settings(model="synthetic", sim_memory_bytes=100 * MIB, watermark=1.0,
                        models={"synthetic": ModelOverrides(max_batch_size=8, max_inflight_batches=2,
                                                            params={"weights_mib": 0, "fixed_mib": 0, "item_mib": 10})})
    backend = SyntheticBackend(settings.model_config_for("synthetic"), "sim", settings)
    budget = start_budget(backend, settings, settings.model_config_for("synthetic"))
    assert budget.plan.inflight_batches == 2 and budget.plan.planned_batch_size == 5
    running, most = [0], [0]
    lock = threading.Lock()

    def forward() -> None:
        with budget.admit(4, 1) as admitted:  # 40 MiB predicted of a 100 MiB budget
            assert admitted
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1

    threads = [threading.Thread(target=forward) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert most[0] == 2 and running[0] == 0
    assert budget.max_concurrent_forwards == 2
