"""The simulated device (`VRAMGUARD_DEVICE=sim`): a **test and demo device** whose memory follows
the rules of PyTorch's CUDA caching allocator and of the driver under it, so the memory planner,
the soft guard and the OOM paths run, and can fail as they would on a GPU, on a CPU-only machine.

Compute runs on the CPU; only memory is simulated. A model on `sim` calls `allocate`/`release`
(or `transient` for a forward's activations) for the bytes its tensors would take. The rules
(sources: c10/cuda/CUDACachingAllocator.cpp; https://pytorch.org/docs/stable/notes/cuda.html):
- Blocks and segments as worker/memory/simalloc.py keeps them: 512 B rounding, the small pool (<= 1 MiB,
  2 MiB segments) and the large pool (20 MiB segments under 10 MiB, else rounded to 2 MiB), best
  fit and splitting, freed blocks cached in their segment until `empty_cache`.
- `memory_allocated` = live blocks (rounded), `memory_reserved` = segments: the allocator's own
  memory, the only memory torch.cuda reports.
- `set_per_process_memory_fraction` is checked only when a new segment is cudaMalloc'ed
  (reserved + segment > fraction x total); a cached block is reused without any check, so
  memory reserved before the cap stays reserved after it. When cudaMalloc fails (the fraction
  or the device), the allocator releases its unused cached segments and tries once more before
  it raises the real `torch.cuda.OutOfMemoryError`.
- Outside the allocator: a CUDA context taken when the device is configured (as `cuInit` and the
  primary context are, before any tensor) and kernel-module memory loaded lazily at the first
  kernel launch (`launch`, called by `transient`; CUDA_MODULE_LOADING=LAZY, the default since
  CUDA 11.7). They count in the device's used memory (`mem_get_info`, `processes`: what NVML
  shows) but never in memory_reserved, and the fraction does not cover them (it caps the
  allocator only).
A simulated GPU is shared like a real one: processes pinned to the same simulated GPU
(Settings.cuda_visible_devices) record reserved + outside memory per process in its ledger
(worker/memory/ledger.py), the per-process view NVML gives; a cudaMalloc that would take the GPU past its
total fails in the process that asked. An unpinned process gets a device of its own.
One device per process (CUDA's allocator is per process too): `configure` creates it, `current`
returns it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vramguard.worker.memory.ledger import DeviceLedger
from vramguard.worker.memory.simalloc import MIB, MIN_BLOCK_SIZE, Block, CachingAllocator, Segment

__all__ = ["MIB", "Block", "DeviceProcess", "SimDevice", "configure", "current"]


@dataclass(frozen=True, slots=True)
class DeviceProcess:
    """One process on the GPU as NVML lists it: its PID (in its own namespace) and used bytes
    (reserved + outside the allocator)."""

    pid: int
    used_bytes: int


class SimDevice:
    """A device of `total_bytes` with torch.cuda's accounting interface and the caching allocator's
    rules (module docstring). `context_bytes` is held from creation, `module_bytes` from the first
    kernel launch; `expandable_segments` models PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    Thread-safe. Raises ValueError for a size <= 0 or one that disagrees with its GPU's ledger."""

    def __init__(self, total_bytes: int, ledger: DeviceLedger | None = None, *, context_bytes: int = 0,
                 module_bytes: int = 0, expandable_segments: bool = False) -> None:
        if total_bytes <= 0:
            raise ValueError(f"simulated device size must be positive, got {total_bytes}")
        self.total_bytes = total_bytes
        self.fraction = 1.0
        self.ledger = ledger
        self.context_bytes = context_bytes
        self.module_bytes = module_bytes
        self.modules_loaded = False
        self.alloc = CachingAllocator(expandable_segments)
        self._live: dict[int, list[Block]] = {}  # requested bytes -> live blocks (release by size)
        self._lock = threading.RLock()
        self._nothing = Segment(0, small=True)  # the "segment" of empty allocations
        self._pending: deque[Block] = deque()  # freed by finalizers (worker/memory/mirror.py), not yet applied
        if ledger is not None:
            with ledger.update() as record:
                known = record.get("total_bytes")
                if known not in (None, total_bytes) and ledger.others(record, "reserved_bytes") > 0:
                    raise ValueError(f"simulated GPU {ledger.device_id} has {known} bytes for its other processes; "
                                     f"this one was configured with {total_bytes} (VRAMGUARD_SIM_MEMORY_BYTES)")
                record["total_bytes"] = total_bytes
                self._record(record)

    # --- torch.cuda's accounting ---

    @property
    def limit_bytes(self) -> int:
        """What this process's allocator may reserve: total x the per-process memory fraction."""
        return int(self.total_bytes * self.fraction)

    @property
    def outside_bytes(self) -> int:
        """This process's memory outside the allocator now: context, plus modules once loaded."""
        return self.context_bytes + (self.module_bytes if self.modules_loaded else 0)

    def memory_allocated(self) -> int:
        self._drain()
        return self.alloc.allocated

    def memory_reserved(self) -> int:
        self._drain()
        return self.alloc.reserved

    def max_memory_allocated(self) -> int:
        return self.alloc.peak

    def max_memory_reserved(self) -> int:
        return self.alloc.max_reserved

    def reset_peak_memory_stats(self) -> None:
        self._drain()
        with self._lock:
            self.alloc.peak = self.alloc.allocated
            self.alloc.max_reserved = self.alloc.reserved

    def empty_cache(self) -> None:
        """Give the segments with no live block back to the device (torch.cuda.empty_cache)."""
        self._drain()
        with self._lock:
            if self.alloc.release_cached() and self.ledger is not None:
                with self.ledger.update() as record:
                    self._record(record)

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Cap this process's allocator at `fraction` (0-1] of the device, like torch.cuda's: checked
        at the next new segment, never against what is reserved already. Raises ValueError."""
        if not 0 < fraction <= 1:
            raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
        with self._lock:
            self.fraction = fraction
            if self.ledger is not None:  # for watchers of the GPU (tests): reserved vs this cap
                with self.ledger.update() as record:
                    self._record(record)

    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes), as torch.cuda.mem_get_info: total minus every process's used memory."""
        used = sum(p.used_bytes for p in self.processes())
        return max(0, self.total_bytes - used), self.total_bytes

    def processes(self) -> list[DeviceProcess]:
        """The processes on this GPU with their used memory, this one included (NVML's
        nvmlDeviceGetComputeRunningProcesses)."""
        self._drain()
        mine = DeviceProcess(0, self.alloc.reserved + self.outside_bytes)
        if self.ledger is None:
            return [mine]
        with self.ledger.update() as record:
            self._record(record)
            return [DeviceProcess(int(p.get("pid", 0)),
                                  int(p.get("reserved_bytes", 0)) + int(p.get("outside_bytes", 0)))
                    for p in record["processes"].values()]

    # --- what models call ---

    def allocate(self, nbytes: int) -> Block:
        """Take a block of `nbytes` (bytes) and return it (give it back with `release`). Raises
        torch.cuda.OutOfMemoryError, with CUDA's wording, when no cached block holds it and a new
        segment would pass this process's fraction or what its neighbours leave on the GPU."""
        if nbytes <= 0:  # PyTorch hands out a null pointer for an empty tensor: no block, no memory
            return Block(self._nothing, 0)
        with self._lock:
            self._drain()
            reason: list[str] = []
            block = self.alloc.malloc(nbytes, lambda size, checked: self._device_malloc(size, checked, reason))
            if block is None:
                raise self._oom(nbytes, reason[-1] if reason else "no memory")
            self._live.setdefault(nbytes, []).append(block)
            return block

    def release(self, what: int | Block) -> None:
        """Free a block: the one `allocate` returned, or (older callers) the last live block taken
        for that many bytes. It stays reserved, cached in its segment, until `empty_cache`.
        Raises ValueError for a block that is not live."""
        if isinstance(what, Block) and what.segment is self._nothing or what == 0:
            return
        with self._lock:
            if isinstance(what, Block):
                blocks = self._live.get(self._requested(what), [])
                if what in blocks:
                    blocks.remove(what)
                self.alloc.free(what)
                return
            blocks = self._live.get(what, [])
            if not blocks:
                raise ValueError(f"no live block of {what} bytes to release")
            self.alloc.free(blocks.pop())

    def release_later(self, block: Block) -> None:
        """Free `block` at the device's next call, in the order frees arrived: for a finalizer,
        which may run in the middle of an allocation on this very thread (a garbage collection)
        and so must not touch the blocks then."""
        self._pending.append(block)

    def _drain(self) -> None:
        if not self._pending:
            return
        with self._lock:
            while self._pending:
                self.release(self._pending.popleft())

    def fill(self) -> list[Block]:
        """Take every byte the allocator can still get (cached free blocks, then new segments up
        to the cap and the GPU's free memory), as a leak does; returns the blocks taken."""
        taken: list[Block] = []
        size = max(self.limit_bytes - self.alloc.reserved, self.alloc.largest_free_block())
        while size >= MIN_BLOCK_SIZE:
            try:
                taken.append(self.allocate(size))
            except Exception:  # noqa: BLE001 - torch.cuda.OutOfMemoryError: try a smaller piece
                size //= 2
        return taken

    def launch(self) -> None:
        """A kernel launch: the first one loads the kernel modules (lazy loading) outside the
        allocator. Raises RuntimeError with CUDA's text when the GPU has no room for them."""
        with self._lock:
            if self.modules_loaded or not self.module_bytes:
                self.modules_loaded = True
                return
            self.modules_loaded = True
            if self.ledger is None:
                return
            with self.ledger.update() as record:
                if self.ledger.others(record, "reserved_bytes") + self.ledger.others(record, "outside_bytes") + \
                        self.alloc.reserved + self.outside_bytes > self.total_bytes:
                    self.modules_loaded = False
                    raise RuntimeError("CUDA error: out of memory (simulated: loading a kernel module)")
                self._record(record)

    @contextmanager
    def transient(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the duration of a block: a forward's kernels and activations."""
        self.launch()
        block = self.allocate(nbytes)
        try:
            yield
        finally:
            self.release(block)

    # --- the device under the allocator ---

    def _requested(self, block: Block) -> int:
        return next((n for n, blocks in self._live.items() if block in blocks), -1)

    def _device_malloc(self, size: int, checked: int, reason: list[str]) -> bool:
        """cudaMalloc of a new segment (or the pages an expandable segment maps) of `size` bytes:
        the per-process fraction first, on `checked` bytes (the request's alloc_size, the allocator's
        own check), then the GPU's free memory on `size`. Records the new reserved bytes in the ledger."""
        if self.alloc.reserved + checked > self.limit_bytes:
            reason.append(f"a limit of {self.limit_bytes / MIB:.2f} MiB for this process's allocator "
                          f"({self.alloc.reserved / MIB:.2f} MiB reserved)")
            return False
        if self.ledger is None:
            if self.alloc.reserved + self.outside_bytes + size > self.total_bytes:
                reason.append("no free memory on the device")
                return False
            return True
        with self.ledger.update() as record:
            others = int(self.ledger.others(record, "reserved_bytes") + self.ledger.others(record, "outside_bytes"))
            if others + self.alloc.reserved + self.outside_bytes + size > self.total_bytes:
                reason.append(f"{others / MIB:.2f} MiB used by other processes on this GPU")
                return False
            entry = self._record(record)
            entry["reserved_bytes"] += size  # the allocator adds the segment right after this returns
        return True

    def _record(self, record: dict[str, Any]) -> dict[str, Any]:
        assert self.ledger is not None
        entry = self.ledger.mine(record)
        entry["reserved_bytes"] = self.alloc.reserved
        entry["outside_bytes"] = self.outside_bytes
        entry["cap_bytes"] = self.limit_bytes
        return entry

    def _oom(self, nbytes: int, what: str) -> Exception:
        import torch

        return torch.cuda.OutOfMemoryError(
            f"CUDA out of memory (simulated device). Tried to allocate {nbytes / MIB:.2f} MiB. "
            f"Device has a total capacity of {self.total_bytes / MIB:.2f} MiB, {what}, of which "
            f"{self.alloc.allocated / MIB:.2f} MiB is allocated by PyTorch and "
            f"{(self.alloc.reserved - self.alloc.allocated) / MIB:.2f} MiB is reserved by PyTorch but unallocated."
        )


_current: SimDevice | None = None


def configure(total_bytes: int, ledger: DeviceLedger | None = None, *, context_bytes: int = 0,
              module_bytes: int = 0, expandable_segments: bool = False) -> SimDevice:
    """Create this process's simulated device (replacing any previous one) and return it; with a
    `ledger`, the device is the simulated GPU that ledger describes, shared with its other processes.
    `context_bytes`/`module_bytes`: memory outside the allocator (the CUDA context, lazily loaded modules)."""
    global _current
    _current = SimDevice(total_bytes, ledger, context_bytes=context_bytes, module_bytes=module_bytes,
                         expandable_segments=expandable_segments)
    return _current


def current() -> SimDevice:
    """This process's simulated device. Raises RuntimeError when `configure` was not called."""
    if _current is None:
        raise RuntimeError("the simulated device is not configured (worker.simdevice.configure)")
    return _current
