"""The per-device ledger (worker/memory/ledger.py) and the simulated GPU shared through it
(worker/memory/simdevice.py). A neighbour is a real other process that holds its ledger entry (and its
liveness lock) until the test kills it; "containers" are processes in PID namespaces of their own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from vramguard.worker.memory.ledger import DeviceLedger, LedgerCorruptError, PlacementError
from vramguard.worker.memory.simdevice import MIB, SimDevice

ROOT = Path(__file__).resolve().parents[2]
NEIGHBOUR = """
import json, sys
from pathlib import Path
from vramguard.worker.memory.ledger import DeviceLedger
ledger = DeviceLedger(Path(sys.argv[1]), sys.argv[2])
with ledger.update() as record:
    ledger.mine(record).update(json.loads(sys.argv[3]))
print("ready", flush=True)
sys.stdin.read()
"""

Neighbour = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def neighbour(tmp_path: Path) -> Iterator[Neighbour]:
    """Start a process that registers `entry` in the ledger of `device` and lives until killed;
    `namespace=True` runs it in a PID namespace of its own (`unshare --pid --fork`, as root)."""
    procs: list[subprocess.Popen[str]] = []

    def start(device: str = "sim-0", namespace: bool = False, **entry: object) -> subprocess.Popen[str]:
        prefix = ["unshare", "--pid", "--fork", "--kill-child"] if namespace else []
        proc = subprocess.Popen([*prefix, sys.executable, "-c", NEIGHBOUR, str(tmp_path), device, json.dumps(entry)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        kill(proc)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.communicate()  # reaps it and closes its pipes


def eventually(check: Callable[[], object], timeout_s: float = 30.0) -> object:
    """`check()`'s value once it stops raising PlacementError (a killed process's lock is dropped
    by the kernel when the process is gone, a moment after its parent saw it exit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except PlacementError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_share_that_would_over_commit_the_gpu_is_refused_naming_it(tmp_path: Path, neighbour: Neighbour) -> None:
    ledger = DeviceLedger(tmp_path, "sim-0")
    neighbour(share=0.5)
    with pytest.raises(PlacementError, match=r"GPU sim-0: this worker's memory share 0.4 plus the 0.5"):
        ledger.register_share(0.4, watermark=0.8)
    assert ledger.register_share(0.3, watermark=0.8) == pytest.approx(0.5)


def test_shares_of_dead_processes_come_back(tmp_path: Path, neighbour: Neighbour) -> None:
    ledger = DeviceLedger(tmp_path, "sim-0")
    kill(neighbour(share=0.8, reserved_bytes=100))
    assert ledger.register_share(0.8, watermark=0.8) == 0
    assert list(json.loads(ledger.path.read_text())["processes"]) == [ledger.entry_id]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_workers_in_other_pid_namespaces_are_counted_and_released_when_killed(
    tmp_path: Path, neighbour: Neighbour,
) -> None:
    """1. Two "containers": processes in PID namespaces of their own (each is PID 1 there) share
       the ledger folder and register 0.4 each.
    2. A third worker asks for 0.1: refused. The first container is killed.
    Result: both shares were counted although their PIDs are equal; the kill released one."""
    first = neighbour(namespace=True, share=0.4)
    neighbour(namespace=True, share=0.4)
    pids = {p["pid"] for p in json.loads((tmp_path / "sim-0.json").read_text())["processes"].values()}
    assert pids == {1}  # the PIDs collide: liveness cannot be a PID
    ledger = DeviceLedger(tmp_path, "sim-0")
    with pytest.raises(PlacementError, match="plus the 0.8 that 2 live worker"):
        ledger.register_share(0.1, watermark=0.8)
    kill(first)  # unshare dies; --kill-child takes the process in the namespace with it
    assert eventually(lambda: ledger.register_share(0.4, watermark=0.8)) == pytest.approx(0.4)


def test_a_writer_that_dies_mid_write_never_loses_the_other_entries(
    tmp_path: Path, neighbour: Neighbour, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1. A neighbour holds a share of 0.3. This process's update fails half way through writing
       (its serialisation raises, where a SIGKILL would stop it).
    Result: the record on disk is the old one, whole: the neighbour's share is still counted."""
    neighbour(share=0.3)
    ledger = DeviceLedger(tmp_path, "sim-0")

    def broken(*args: object, **kwargs: object) -> str:
        raise OSError("killed mid-write")

    monkeypatch.setattr("vramguard.worker.memory.ledger.json.dumps", broken)
    with pytest.raises(OSError, match="killed mid-write"):
        ledger.register_share(0.2, watermark=0.8)
    monkeypatch.undo()
    assert ledger.register_share(0.5, watermark=0.8) == pytest.approx(0.3)


def test_a_corrupt_ledger_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "sim-0.json").write_text("{not json")
    with pytest.raises(LedgerCorruptError, match=r"sim-0.json is not valid JSON .*delete the file"):
        DeviceLedger(tmp_path, "sim-0").register_share(0.4, watermark=0.8)
    (tmp_path / "sim-1.json").write_text("[1, 2]")
    with pytest.raises(LedgerCorruptError, match="does not hold a ledger record"):
        DeviceLedger(tmp_path, "sim-1").register_share(0.4, watermark=0.8)


def test_neighbours_memory_is_seen_and_the_allocation_crossing_the_total_fails(
    tmp_path: Path, neighbour: Neighbour,
) -> None:
    ledger = DeviceLedger(tmp_path, "sim-0")
    dev = SimDevice(100 * MIB, ledger, context_bytes=5 * MIB)
    neighbour(reserved_bytes=60 * MIB, outside_bytes=10 * MIB)
    assert dev.mem_get_info() == (25 * MIB, 100 * MIB)
    assert sorted(p.used_bytes for p in dev.processes()) == [5 * MIB, 70 * MIB]
    dev.allocate(20 * MIB)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="70.00 MiB used by other processes"):
        dev.allocate(20 * MIB)
    assert dev.memory_allocated() == 20 * MIB  # a failed allocation takes nothing
    entry = json.loads(ledger.path.read_text())["processes"][ledger.entry_id]
    assert entry["reserved_bytes"] == 20 * MIB and entry["outside_bytes"] == 5 * MIB


def test_the_process_drops_its_own_cache_before_reporting_oom(tmp_path: Path, neighbour: Neighbour) -> None:
    """As the CUDA caching allocator does: cached segments go back before an allocation fails."""
    ledger = DeviceLedger(tmp_path, "sim-0")
    dev = SimDevice(100 * MIB, ledger)
    with dev.transient(30 * MIB):
        pass
    assert dev.memory_reserved() == 30 * MIB
    neighbour(reserved_bytes=45 * MIB)
    dev.allocate(50 * MIB)  # 45 + 30 cached + 50 > 100, but 45 + 50 fits once the cache is dropped
    assert dev.memory_reserved() == 50 * MIB


def test_a_gpu_of_another_size_is_refused(tmp_path: Path, neighbour: Neighbour) -> None:
    neighbour(device="sim-1", reserved_bytes=MIB)
    ledger = DeviceLedger(tmp_path, "sim-1")
    with ledger.update() as record:
        record["total_bytes"] = 200 * MIB
    with pytest.raises(ValueError, match="VRAMGUARD_SIM_MEMORY_BYTES"):
        SimDevice(100 * MIB, ledger)


def test_concurrent_forwards_are_admitted_only_while_their_peaks_fit(tmp_path: Path) -> None:
    """Four threads each run a forward whose predicted peak is 40 % of the room: the soft guard
    lets at most two run at once, and every one of them runs."""
    from vramguard.shared.models import ModelOverrides
    from vramguard.shared.settings import Settings
    from vramguard.worker.memory.budget import start_budget
    from vramguard.worker.models.synthetic import SyntheticBackend

    settings = Settings(model="synthetic", sim_memory_bytes=100 * MIB, watermark=1.0, sim_context_bytes=0,
                        sim_module_bytes=0,
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


def test_promised_not_held_sums_what_the_others_registered_and_do_not_hold_yet(tmp_path: Path) -> None:
    """Shares are promises (worker/memory/ledger.py): a neighbour of share 0.3 on a 1000 MiB GPU that
    holds 100 MiB is still promised 200 MiB; one that holds more than its share is promised nothing;
    this worker's own entry never counts."""
    mib = 1024 * 1024
    first, second, me = (DeviceLedger(tmp_path, "GPU-x") for _ in range(3))
    first.register_share(0.3, 0.8)
    first.record_held(90 * mib, 10 * mib)
    second.register_share(0.1, 0.8)
    second.record_held(120 * mib, 0)
    me.register_share(0.2, 0.8)
    assert me.promised_not_held(1000 * mib) == (int(0.3 * 1000 * mib) - 100 * mib, 1)
    first.close()  # a dead worker's promise goes with it
    assert me.promised_not_held(1000 * mib) == (0, 0)
