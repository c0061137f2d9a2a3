"""Watch a simulated GPU the way NVML shows a real one: a thread reads the device ledger
(worker/memory/ledger.py; written atomically, so it is read without its lock) every few milliseconds and
keeps the worst figures: device used memory (reserved + outside the allocator, all processes) and
how far any process's reserved memory went above its allocator cap."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import TracebackType

MIB = 1024 * 1024


class GpuWatch:
    """`with GpuWatch(folder, "sim-0") as watch:` samples until the block ends."""

    def __init__(self, folder: Path, device_id: str, interval_s: float = 0.01) -> None:
        self.path = folder / f"{device_id}.json"
        self.interval_s = interval_s
        self.samples = 0
        self.max_used_bytes = 0
        self.max_reserved_bytes = 0
        self.max_over_cap_bytes = -(1 << 62)  # reserved - cap, worst process and sample
        self.worst_reserved_vs_cap: tuple[int, int] = (0, 0)
        self.processes_seen: int = 0
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        try:
            record = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        processes = record.get("processes", {})
        self.samples += 1
        self._seen.update(processes)
        self.processes_seen = len(self._seen)
        used = sum(int(p.get("reserved_bytes", 0)) + int(p.get("outside_bytes", 0)) for p in processes.values())
        self.max_used_bytes = max(self.max_used_bytes, used)
        for p in processes.values():
            reserved, cap = int(p.get("reserved_bytes", 0)), int(p.get("cap_bytes", 1 << 62))
            self.max_reserved_bytes = max(self.max_reserved_bytes, reserved)
            if reserved - cap > self.max_over_cap_bytes:
                self.max_over_cap_bytes = reserved - cap
                self.worst_reserved_vs_cap = (reserved, cap)

    def summary(self) -> str:
        reserved, cap = self.worst_reserved_vs_cap
        return (f"samples={self.samples} processes={self.processes_seen} "
                f"max device used={self.max_used_bytes / MIB:.1f} "
                f"MiB, max reserved={self.max_reserved_bytes / MIB:.1f} MiB, closest to its cap: reserved "
                f"{reserved / MIB:.1f} MiB of cap {cap / MIB:.1f} MiB")
