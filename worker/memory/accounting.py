"""Device memory accounting behind one interface for CUDA, the CPU and the simulated device:
total, allocated, reserved, peak, reset, free the cache, cap the process. worker/memory/budget.py
measures and plans through it; the heartbeat publishes its snapshot. Never touches Redis."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Protocol

from vramguard.worker.memory import simdevice
from vramguard.worker.memory.ledger import DeviceLedger


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

    def max_reserved_bytes(self) -> int:
        """Highest reserved since the last `reset_peak` (torch.cuda.max_memory_reserved)."""

    def reset_peak(self) -> None: ...

    def empty_cache(self) -> None:
        """Give cached, unused blocks back to the device (after an OOM)."""

    def context_bytes(self) -> int:
        """What this process itself holds on the device outside the allocator now (on CUDA its
        context and the kernel modules loaded so far), never what neighbouring processes hold.
        Measured afresh on each call where the device tells (NVML per process, the simulator)."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device as its driver sees them (every process counted)."""

    def other_processes(self) -> list[tuple[int, int]]:
        """(pid, used bytes) of the other processes on the device, where the device tells (NVML,
        the simulator's ledger); empty otherwise."""

    def device_uuid(self) -> str:
        """The device's UUID ("GPU-..." on CUDA, "SIM-<gpu>" on sim, "" on the CPU)."""

    def limit_fraction(self, fraction: float) -> None:
        """Hard-cap this process at `fraction` of the device (no-op where the device has no such cap)."""


class CudaAccounting:
    """torch.cuda's caching-allocator statistics
    (https://pytorch.org/docs/stable/notes/cuda.html#memory-management).

    The CUDA context is measured when the accounting is created, before the process allocates
    anything: NVML's device-used memory just before and just after this process initialises CUDA.
    Neighbours that allocate in that instant would inflate it, so where NVML lists this process
    (it does unless a container hides the host's PIDs) its own per-process figure wins.
    """

    kind = "cuda"

    def __init__(self, gpu: str | None = None) -> None:
        import torch

        self._cuda = torch.cuda
        self._gpu = gpu
        used_before = _nvml_used_bytes(gpu)
        self._cuda.init()  # type: ignore[no-untyped-call]
        self._cuda.synchronize()
        self._context = _measure_context(gpu, used_before, self.reserved_bytes())

    def total_bytes(self) -> int:
        return int(self._cuda.get_device_properties(self._cuda.current_device()).total_memory)

    def allocated_bytes(self) -> int:
        return int(self._cuda.memory_allocated())

    def reserved_bytes(self) -> int:
        return int(self._cuda.memory_reserved())

    def peak_bytes(self) -> int:
        return int(self._cuda.max_memory_allocated())

    def max_reserved_bytes(self) -> int:
        return int(self._cuda.max_memory_reserved())

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self._cuda.empty_cache()

    def context_bytes(self) -> int:
        """The context as measured at start, raised to NVML's per-process used minus reserved now
        when NVML lists this process (it does unless a container hides the host's PIDs): lazily
        loaded kernel modules (cuBLAS, cuDNN) land there after the first forwards."""
        now = _nvml_own_outside(self._gpu, self.reserved_bytes())
        if now is not None:
            self._context = now
        return self._context

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._cuda.mem_get_info()
        return int(free), int(total)

    def other_processes(self) -> list[tuple[int, int]]:
        return _nvml_processes(self._gpu, exclude=os.getpid())

    def device_uuid(self) -> str:
        uuid = str(getattr(self._cuda.get_device_properties(self._cuda.current_device()), "uuid", ""))
        return uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"

    def limit_fraction(self, fraction: float) -> None:
        self._cuda.set_per_process_memory_fraction(fraction)


# A CUDA 12 context with cuBLAS loaded takes roughly 300-600 MiB (NVIDIA's "CUDA C++ Best
# Practices Guide" on lazy loading gives the order of magnitude); used only when NVML is missing.
CUDA_CONTEXT_FALLBACK_BYTES = 512 * 1024 * 1024


def _nvml_handle(gpu: str | None):  # type: ignore[no-untyped-def]
    """NVML's handle of the GPU this process uses (Settings.cuda_visible_devices: an index, in
    the PCI order that `make up` asks CUDA for too, or a UUID). Raises where NVML is unavailable."""
    import pynvml

    pynvml.nvmlInit()
    visible = (gpu or "0").split(",")[0].strip()
    if visible.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(visible)
    return pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))


def _nvml_used_bytes(gpu: str | None) -> int | None:
    try:
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(gpu)).used)
    except Exception:  # noqa: BLE001 - no NVML: fall back below
        return None


def _nvml_processes(gpu: str | None, exclude: int | None = None) -> list[tuple[int, int]]:
    """(pid, used bytes) of the compute processes NVML lists on the GPU; empty without NVML."""
    try:
        import pynvml

        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_handle(gpu))
    except Exception:  # noqa: BLE001 - NVML missing: the caller says nothing about processes
        return []
    return [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs if p.pid != exclude]


def _nvml_own_outside(gpu: str | None, reserved: int) -> int | None:
    """NVML's used memory of this process minus what its allocator reserves; None where NVML does
    not list this PID (no NVML, or a container that hides the host's PIDs)."""
    own = [used for pid, used in _nvml_processes(gpu) if pid == os.getpid()]
    return max(0, own[0] - reserved) if own and own[0] else None


def _measure_context(gpu: str | None, used_before: int | None, reserved: int) -> int:
    """This process's device memory outside the allocator: NVML's per-process figure, else the
    device-used delta across CUDA initialisation, else CUDA_CONTEXT_FALLBACK_BYTES."""
    own = _nvml_own_outside(gpu, reserved)
    if own is not None:
        return own
    used_after = _nvml_used_bytes(gpu)
    if used_before is not None and used_after is not None:
        return max(0, used_after - used_before - reserved)
    return CUDA_CONTEXT_FALLBACK_BYTES


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

    def max_reserved_bytes(self) -> int:
        return self.peak_bytes()

    def reset_peak(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def empty_cache(self) -> None:
        pass

    def context_bytes(self) -> int:
        """The resident set before any weights: the interpreter, torch and the libraries."""
        return self.allocated_bytes()

    def mem_get_info(self) -> tuple[int, int]:
        """(available RAM, total RAM): /proc/meminfo's MemAvailable."""
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, self.total_bytes()
        except OSError:
            pass
        return self.total_bytes(), self.total_bytes()

    def other_processes(self) -> list[tuple[int, int]]:
        return []

    def device_uuid(self) -> str:
        return ""

    def limit_fraction(self, fraction: float) -> None:
        pass  # the OS, not the process, caps CPU memory (cgroups)


class SimAccounting:
    """The simulated device of worker/memory/simdevice.py (tests and demos)."""

    kind = "sim"

    def __init__(self, device: simdevice.SimDevice, gpu: str) -> None:
        self.device = device
        self.gpu = gpu

    def total_bytes(self) -> int:
        return self.device.total_bytes

    def allocated_bytes(self) -> int:
        return self.device.memory_allocated()

    def reserved_bytes(self) -> int:
        return self.device.memory_reserved()

    def peak_bytes(self) -> int:
        return self.device.max_memory_allocated()

    def max_reserved_bytes(self) -> int:
        return self.device.max_memory_reserved()

    def reset_peak(self) -> None:
        self.device.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self.device.empty_cache()

    def context_bytes(self) -> int:
        """The simulator's own figure: its context, plus its kernel modules once loaded."""
        return self.device.outside_bytes

    def mem_get_info(self) -> tuple[int, int]:
        return self.device.mem_get_info()

    def other_processes(self) -> list[tuple[int, int]]:
        """The other processes of the simulated GPU's ledger (this one is the entry with its PID
        and the same used bytes; PIDs of other containers may repeat, which only names them)."""
        mine = self.device.alloc.reserved + self.device.outside_bytes
        procs = [(p.pid, p.used_bytes) for p in self.device.processes()]
        own = next((i for i, (pid, used) in enumerate(procs) if pid == os.getpid() and used == mine), None)
        return [p for i, p in enumerate(procs) if i != own]

    def device_uuid(self) -> str:
        return f"SIM-{self.gpu}"

    def limit_fraction(self, fraction: float) -> None:
        self.device.set_per_process_memory_fraction(fraction)


def open_accounting(device: str, sim_total_bytes: int, gpu: str | None = None,
                    ledger_folder: Path | None = None, *, sim_context_bytes: int = 0,
                    sim_module_bytes: int = 0) -> MemoryAccounting:
    """The accounting for a resolved device string ("cuda", "cuda:0", "cpu", "sim").

    For "sim" this creates the process's simulated device of `sim_total_bytes` (so call it before
    the backend loads its weights): the simulated GPU `gpu` shared through its ledger in
    `ledger_folder` when both are given, else a device of this process alone, with
    `sim_context_bytes` / `sim_module_bytes` outside its allocator and expandable segments when
    PYTORCH_CUDA_ALLOC_CONF says so (as PyTorch reads it). Raises ValueError for another device.
    """
    if device.startswith("cuda"):
        return CudaAccounting(gpu)
    if device == "cpu":
        return CpuAccounting()
    if device == "sim":
        ledger = DeviceLedger(ledger_folder, f"sim-{gpu}") if gpu and ledger_folder else None
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        expandable = "expandable_segments:true" in conf
        device_ = simdevice.configure(sim_total_bytes, ledger, context_bytes=sim_context_bytes,
                                      module_bytes=sim_module_bytes, expandable_segments=expandable)
        return SimAccounting(device_, gpu or "0")
    raise ValueError(f"no memory accounting for device {device!r}")
