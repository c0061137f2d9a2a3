"""The per-device ledger: what every worker process that uses one GPU has registered there (its
memory share and, on the simulated device, the memory it holds), shared by the workers of a host
or, through a shared folder (a volume, a hostPath), by the containers of one GPU.

Two things need it. Shares: a worker registers its share before it plans, and one whose share
would take the GPU's registered shares past the watermark is refused, so workers started in any
order (or by hand, or by a second `make up`) cannot over-commit a GPU. The simulated device
(worker/memory/simdevice.py): neighbours on one simulated GPU see each other's memory, as on a real one.

Files in the folder, per device: `<device>.json` (the record), `<device>.lock` (taken with an
exclusive `fcntl.flock` around every read-modify-write), and `<device>.live/<entry>`: each
process holds an exclusive flock on its own file there for its whole life. Liveness is that lock,
never a PID: the kernel drops it when the process dies, whatever PID namespace (container) it ran
in, so a SIGKILLed worker's share and memory come back to the GPU at the next update and PIDs of
different containers never collide. An update writes a new file and renames it over the record
(atomic on POSIX), so a kill mid-write never loses the other processes' entries. Never touches
Redis or torch.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

DEFAULT_DIR_NAME = "vramguard-devices"
SHARE_TOLERANCE = 1e-9  # shares are fractions like 0.8 / 3: compare with float noise forgiven


class PlacementError(RuntimeError):
    """This worker cannot have its memory share on its GPU: the shares registered there would pass
    the watermark, or the GPU does not have the budget free; the message names the GPU and the figures."""


class LedgerCorruptError(PlacementError):
    """The ledger file is not a ledger (hand-edited, another program's file): the message names it."""


def ledger_dir(setting: str | None) -> Path:
    """The folder of the ledgers: Settings.device_ledger_dir, else <tmp>/vramguard-devices."""
    return Path(setting) if setting else Path(tempfile.gettempdir()) / DEFAULT_DIR_NAME


def _held_by_someone(path: Path) -> bool:
    """Whether a live process holds the flock on `path` (try to take it without waiting)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, the lock with it
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        return False


class DeviceLedger:
    """The ledger of one device. Its record:
    {"total_bytes": int | null, "processes": {"<entry id>": {"pid": int, "host": str, "share": float,
    "reserved_bytes": int, "outside_bytes": int}}}; an entry id is unique per process (not a PID)."""

    def __init__(self, folder: Path, device_id: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)
        self.device_id = device_id
        self.path = folder / f"{safe}.json"
        self._mutex_path = folder / f"{safe}.lock"
        self._live_dir = folder / f"{safe}.live"
        self.entry_id = uuid.uuid4().hex
        self._alive_handle: IO[bytes] | None = None

    @property
    def pid(self) -> str:
        """This process's entry id in the record (kept under this name for older callers)."""
        return self.entry_id

    def _hold_alive_lock(self) -> None:
        """Create this process's liveness file and keep its flock until the process exits."""
        if self._alive_handle is not None:
            return
        self._live_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self._live_dir / self.entry_id, "wb")  # noqa: SIM115 - held for the process's life
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._alive_handle = handle
        weakref.finalize(self, handle.close)  # a ledger dropped in-process (tests) lets go of its lock

    def close(self) -> None:
        """Let go of this process's liveness lock: its entry counts as dead from the next update."""
        if self._alive_handle is not None:
            self._alive_handle.close()
            self._alive_handle = None

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"processes": {}}
        try:
            record = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise LedgerCorruptError(f"the device ledger {self.path} is not valid JSON ({exc}); it is rebuilt by "
                                     "the workers of that GPU: stop them and delete the file") from None
        if not isinstance(record, dict) or not isinstance(record.setdefault("processes", {}), dict):
            raise LedgerCorruptError(f"the device ledger {self.path} does not hold a ledger record; stop the "
                                     "workers of that GPU and delete the file")
        return record

    def _write(self, record: dict[str, Any]) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{self.entry_id}.tmp")
        tmp.write_text(json.dumps(record, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, self.path)  # atomic: readers see the old record or the new, never half

    @contextmanager
    def update(self) -> Iterator[dict[str, Any]]:
        """Hold the device's lock, yield its record with the entries of dead processes dropped,
        then write it back atomically. Raises LedgerCorruptError when the file is not a ledger."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._hold_alive_lock()
        with open(self._mutex_path, "a+b") as mutex:
            fcntl.flock(mutex, fcntl.LOCK_EX)
            try:
                record = self._read()
                processes = record["processes"]
                for entry in [e for e in processes if e != self.entry_id and not self._alive(e)]:
                    del processes[entry]
                    (self._live_dir / entry).unlink(missing_ok=True)
                yield record
                self._write(record)
            finally:
                fcntl.flock(mutex, fcntl.LOCK_UN)

    def _alive(self, entry: str) -> bool:
        if "/" in entry or entry.startswith("."):
            return False  # not a name this ledger gave out
        return _held_by_someone(self._live_dir / entry)

    def mine(self, record: dict[str, Any]) -> dict[str, Any]:
        """This process's entry in `record` (created with its PID and host, for messages)."""
        entry: dict[str, Any] = record["processes"].setdefault(self.entry_id, {})
        entry.setdefault("pid", os.getpid())
        entry.setdefault("host", socket.gethostname())
        return entry

    def others(self, record: dict[str, Any], field: str) -> float:
        """The sum of `field` over the other live processes of `record`."""
        return float(sum(p.get(field, 0) for e, p in record["processes"].items() if e != self.entry_id))

    def register_share(self, share: float, watermark: float) -> float:
        """Record this process's `share` of the device. Returns the shares the other live
        processes hold. Raises PlacementError when their sum plus `share` exceeds `watermark`."""
        with self.update() as record:
            others = self.others(record, "share")
            if others + share > watermark + SHARE_TOLERANCE:
                raise PlacementError(
                    f"GPU {self.device_id}: this worker's memory share {share:.4g} plus the {others:.4g} that "
                    f"{len(record['processes']) - (self.entry_id in record['processes'])} live worker(s) there hold "
                    f"exceeds the watermark {watermark:g}; lower VRAMGUARD_MEMORY_SHARE or set "
                    "VRAMGUARD_WORKERS_PER_GPU to the number of workers on that GPU"
                )
            self.mine(record)["share"] = share
            return others

    def promised_not_held(self, total_bytes: int) -> tuple[int, int]:
        """What the other live workers registered here are promised and do not hold yet: the sum
        over them of max(0, share x `total_bytes` - (reserved_bytes + outside_bytes)), in bytes,
        and how many workers have such a remainder. What a worker holds comes from its entry: the
        simulated device records it at every segment it takes or gives back, a CUDA worker when
        its start is done (`record_held`); a figure that is stale because the worker grew since
        counts as not held, so the sum errs on the side of more."""
        promised, workers = 0, 0
        with self.update() as record:
            for entry, process in record["processes"].items():
                if entry == self.entry_id:
                    continue
                held = int(process.get("reserved_bytes", 0)) + int(process.get("outside_bytes", 0))
                rest = int(float(process.get("share", 0.0)) * total_bytes) - held
                if rest > 0:
                    promised, workers = promised + rest, workers + 1
        return promised, workers

    def record_held(self, reserved_bytes: int, outside_bytes: int) -> None:
        """Record what this process holds on the device now (bytes: its allocator's reserved memory
        and its memory outside the allocator), for the free-memory check of workers starting after it."""
        with self.update() as record:
            entry = self.mine(record)
            entry["reserved_bytes"], entry["outside_bytes"] = int(reserved_bytes), int(outside_bytes)

    def release(self) -> None:
        """Drop this process's entry (a clean exit; a dead process's entry is dropped anyway)."""
        with self.update() as record:
            record["processes"].pop(self.entry_id, None)
