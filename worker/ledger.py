"""The per-device ledger: a small JSON file per GPU that every worker process on this host that
uses the GPU reads and writes under an exclusive `fcntl.flock`. It holds, per live process, the
memory share it planned for and, on the simulated device, the bytes it holds.

Two things need it. Shares: a worker registers its share before it plans, and one whose share
would take the GPU's registered shares past the watermark is refused, so workers started in any
order (or by hand, or by a second `make up`) cannot over-commit a GPU. The simulated device
(worker/simdevice.py): neighbours on one simulated GPU see each other's memory, as on a real one.

Entries of processes that no longer exist are dropped on every update, so a SIGKILLed worker's
share and memory come back to the GPU when its successor starts. Never touches Redis or torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEFAULT_DIR_NAME = "vramguard-devices"
SHARE_TOLERANCE = 1e-9  # shares are fractions like 0.8 / 3: compare with float noise forgiven


class PlacementError(RuntimeError):
    """This worker's memory share would over-commit its GPU; the message names the GPU, the
    shares already registered there and the watermark."""


def ledger_dir(setting: str | None) -> Path:
    """The folder of the ledgers: Settings.device_ledger_dir, else <tmp>/vramguard-devices."""
    return Path(setting) if setting else Path(tempfile.gettempdir()) / DEFAULT_DIR_NAME


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class DeviceLedger:
    """The ledger of one device, `<folder>/<device id>.json`:
    {"total_bytes": int | null, "processes": {"<pid>": {"share": float, "reserved_bytes": int}}}."""

    def __init__(self, folder: Path, device_id: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)
        self.device_id = device_id
        self.path = folder / f"{safe}.json"
        self.pid = str(os.getpid())

    @contextmanager
    def update(self) -> Iterator[dict[str, Any]]:
        """Hold the device's lock, yield its record with dead processes dropped, write it back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                handle.seek(0)
                text = handle.read()
                record: dict[str, Any] = json.loads(text) if text.strip() else {}
                processes = record.setdefault("processes", {})
                for pid in [p for p in processes if p != self.pid and not _alive(int(p))]:
                    del processes[pid]
                yield record
                handle.seek(0)
                handle.truncate()
                handle.write(json.dumps(record, separators=(",", ":")))
                handle.flush()
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def mine(self, record: dict[str, Any]) -> dict[str, Any]:
        """This process's entry in `record` (created empty)."""
        entry: dict[str, Any] = record["processes"].setdefault(self.pid, {})
        return entry

    def others(self, record: dict[str, Any], field: str) -> float:
        """The sum of `field` over the other live processes of `record`."""
        return float(sum(p.get(field, 0) for pid, p in record["processes"].items() if pid != self.pid))

    def register_share(self, share: float, watermark: float) -> float:
        """Record this process's `share` of the device. Returns the shares the other live
        processes hold. Raises PlacementError when their sum plus `share` exceeds `watermark`."""
        with self.update() as record:
            others = self.others(record, "share")
            if others + share > watermark + SHARE_TOLERANCE:
                raise PlacementError(
                    f"GPU {self.device_id}: this worker's memory share {share:.4g} plus the {others:.4g} that "
                    f"{len(record['processes']) - (self.pid in record['processes'])} live worker(s) there hold "
                    f"exceeds the watermark {watermark:g}; lower VRAMGUARD_MEMORY_SHARE or set "
                    "VRAMGUARD_WORKERS_PER_GPU to the number of workers on that GPU"
                )
            self.mine(record)["share"] = share
            return others

    def release(self) -> None:
        """Drop this process's entry (a clean exit; a dead process's entry is dropped anyway)."""
        with self.update() as record:
            record["processes"].pop(self.pid, None)
