"""Device memory accounting behind one interface for CUDA, the CPU and the simulated device:
total, allocated, reserved, peak, reset, free the cache, cap the process. worker/memory.py
measures and plans through it; the heartbeat publishes its snapshot. Never touches Redis."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Protocol

from worker import simdevice


class MemoryAccounting(Protocol):
    """What the planner reads from a device. All values in bytes."""

    kind: str  # "cuda" | "cpu" | "sim"

    def total_bytes(self) -> int:
        """The device's memory (a GPU's capacity; the machine's RAM on the CPU)."""

    def allocated_bytes(self) -> int:
        """Bytes held by live tensors now."""

    def reserved_bytes(self) -> int:
        """Allocated plus the allocator's cache."""

    def peak_bytes(self) -> int:
        """Highest allocated since the last `reset_peak`."""

    def reset_peak(self) -> None: ...

    def empty_cache(self) -> None:
        """Give cached, unused blocks back to the device (after an OOM)."""

    def baseline_bytes(self) -> int:
        """Memory the process holds on the device before any weights (the CUDA context)."""

    def limit_fraction(self, fraction: float) -> None:
        """Hard-cap this process at `fraction` of the device (no-op where the device has no such cap)."""


class CudaAccounting:
    """torch.cuda's caching-allocator statistics
    (https://pytorch.org/docs/stable/notes/cuda.html#memory-management)."""

    kind = "cuda"

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._cuda.init()  # type: ignore[no-untyped-call]

    def total_bytes(self) -> int:
        return int(self._cuda.get_device_properties(self._cuda.current_device()).total_memory)

    def allocated_bytes(self) -> int:
        return int(self._cuda.memory_allocated())

    def reserved_bytes(self) -> int:
        return int(self._cuda.memory_reserved())

    def peak_bytes(self) -> int:
        return int(self._cuda.max_memory_allocated())

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self._cuda.empty_cache()

    def baseline_bytes(self) -> int:
        """Device memory in use outside this process's allocator (cudaMemGetInfo): its CUDA context,
        plus whatever neighbours hold at that moment, which makes the plan conservative."""
        free, total = self._cuda.mem_get_info()
        return max(0, int(total - free) - self.reserved_bytes())

    def limit_fraction(self, fraction: float) -> None:
        self._cuda.set_per_process_memory_fraction(fraction)


class CpuAccounting:
    """The process on the CPU: total = the machine's RAM, allocated = reserved = the resident set
    size (RSS), peak = the RSS high-water mark (VmHWM), reset by writing 5 to /proc/self/clear_refs
    (Linux >= 4.0, proc(5)); where that is not allowed, peak = getrusage's ru_maxrss (never reset)."""

    kind = "cpu"

    _STATUS = Path("/proc/self/status")

    def total_bytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _status_kib(self, field: str) -> int | None:
        try:
            for line in self._STATUS.read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except OSError:
            pass
        return None

    def allocated_bytes(self) -> int:
        rss = self._status_kib("VmRSS")
        return rss * 1024 if rss is not None else self.peak_bytes()

    def reserved_bytes(self) -> int:
        return self.allocated_bytes()

    def peak_bytes(self) -> int:
        hwm = self._status_kib("VmHWM")
        if hwm is not None:
            return hwm * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def reset_peak(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def empty_cache(self) -> None:
        pass

    def baseline_bytes(self) -> int:
        return self.allocated_bytes()

    def limit_fraction(self, fraction: float) -> None:
        pass  # the OS, not the process, caps CPU memory (cgroups)


class SimAccounting:
    """The simulated device of worker/simdevice.py (tests and demos)."""

    kind = "sim"

    def __init__(self, device: simdevice.SimDevice) -> None:
        self.device = device

    def total_bytes(self) -> int:
        return self.device.total_bytes

    def allocated_bytes(self) -> int:
        return self.device.memory_allocated()

    def reserved_bytes(self) -> int:
        return self.device.memory_reserved()

    def peak_bytes(self) -> int:
        return self.device.max_memory_allocated()

    def reset_peak(self) -> None:
        self.device.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self.device.empty_cache()

    def baseline_bytes(self) -> int:
        return self.device.memory_reserved()

    def limit_fraction(self, fraction: float) -> None:
        self.device.set_per_process_memory_fraction(fraction)


def open_accounting(device: str, sim_total_bytes: int) -> MemoryAccounting:
    """The accounting for a resolved device string ("cuda", "cuda:0", "cpu", "sim").

    For "sim" this creates the process's simulated device of `sim_total_bytes` (so call it before
    the backend loads its weights). Raises ValueError for another device.
    """
    if device.startswith("cuda"):
        return CudaAccounting()
    if device == "cpu":
        return CpuAccounting()
    if device == "sim":
        return SimAccounting(simdevice.configure(sim_total_bytes))
    raise ValueError(f"no memory accounting for device {device!r}")
