"""The simulated device (`VRAMGUARD_DEVICE=sim`): a **test and demo device** whose memory
accounting follows torch.cuda's caching-allocator statistics, so the memory planner, the soft
guard and the OOM paths run on a CPU-only machine.

Compute runs on the CPU; only memory is simulated. A model on `sim` calls `allocate`/`release`
(or `transient`) for the bytes its weights and activations would take, and `allocate` raises the
real `torch.cuda.OutOfMemoryError` past the device's limit, as the CUDA caching allocator does.
One device per process (CUDA's is per process too): `configure` creates it, `current` returns it.

A simulated GPU is shared like a real one: processes pinned to the same simulated GPU
(Settings.cuda_visible_devices) keep their reserved bytes in that GPU's ledger
(worker/ledger.py), so each sees its neighbours' memory in `mem_get_info`, and the allocation
that would take the GPU past its total raises OutOfMemoryError in the process that asked, as
cudaMalloc does. An unpinned process gets a device of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from vramguard.worker.ledger import DeviceLedger

MIB = 1024 * 1024


class SimDevice:
    """A device of `total_bytes` with torch.cuda's accounting interface.

    Mirrors (https://pytorch.org/docs/stable/notes/cuda.html#memory-management):
    memory_allocated (bytes held by live tensors), memory_reserved (allocated plus the
    allocator's cache: reserved never shrinks until empty_cache), max_memory_allocated
    (peak since reset_peak_memory_stats), set_per_process_memory_fraction (the limit past
    which allocation raises OutOfMemoryError) and mem_get_info (free, total). Thread-safe.
    """

    def __init__(self, total_bytes: int, ledger: DeviceLedger | None = None) -> None:
        if total_bytes <= 0:
            raise ValueError(f"simulated device size must be positive, got {total_bytes}")
        self.total_bytes = total_bytes
        self.fraction = 1.0
        self.ledger = ledger
        self._allocated = 0
        self._reserved = 0
        self._peak = 0
        self._lock = threading.Lock()
        if ledger is not None:
            with ledger.update() as record:
                known = record.get("total_bytes")
                if known not in (None, total_bytes) and ledger.others(record, "reserved_bytes") > 0:
                    raise ValueError(f"simulated GPU {ledger.device_id} has {known} bytes for its other processes; "
                                     f"this one was configured with {total_bytes} (VRAMGUARD_SIM_MEMORY_BYTES)")
                record["total_bytes"] = total_bytes
                ledger.mine(record)["reserved_bytes"] = 0

    @property
    def limit_bytes(self) -> int:
        """Bytes this process may allocate: total x the per-process memory fraction."""
        return int(self.total_bytes * self.fraction)

    def memory_allocated(self) -> int:
        return self._allocated

    def memory_reserved(self) -> int:
        return self._reserved

    def max_memory_allocated(self) -> int:
        return self._peak

    def reset_peak_memory_stats(self) -> None:
        with self._lock:
            self._peak = self._allocated

    def empty_cache(self) -> None:
        """Return the allocator's cached blocks: reserved drops to allocated."""
        with self._lock:
            self._reserved = self._allocated
            if self.ledger is not None:
                with self.ledger.update() as record:
                    self.ledger.mine(record)["reserved_bytes"] = self._reserved

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Limit this process to `fraction` (0-1] of the device, like torch.cuda's. Raises ValueError."""
        if not 0 < fraction <= 1:
            raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes), as torch.cuda.mem_get_info: what no process on this GPU reserves."""
        others = 0
        if self.ledger is not None:
            with self.ledger.update() as record:
                others = int(self.ledger.others(record, "reserved_bytes"))
        return max(0, self.total_bytes - others - self._reserved), self.total_bytes

    def allocate(self, nbytes: int) -> None:
        """Take `nbytes`. Raises torch.cuda.OutOfMemoryError, with CUDA's wording, past this
        process's limit or past what its neighbours on the GPU leave."""
        with self._lock:
            wanted = self._allocated + nbytes
            if wanted > self.limit_bytes:
                raise self._oom(nbytes, f"a limit of {self.limit_bytes / MIB:.2f} MiB for this process")
            reserved = max(self._reserved, wanted)
            if self.ledger is not None:
                reserved = self._reserve_on_device(nbytes, wanted, reserved)
            self._allocated = wanted
            self._reserved = reserved
            self._peak = max(self._peak, self._allocated)

    def _reserve_on_device(self, nbytes: int, wanted: int, reserved: int) -> int:
        """Record `reserved` in the GPU's ledger, or fail when the neighbours' reserved bytes leave
        too little. Like the CUDA caching allocator, which frees its own cached blocks and retries
        before reporting OOM, it first drops this process's cache. Returns the bytes reserved."""
        assert self.ledger is not None
        with self.ledger.update() as record:
            others = int(self.ledger.others(record, "reserved_bytes"))
            if others + reserved > self.total_bytes:
                reserved = wanted
            if others + reserved > self.total_bytes:
                raise self._oom(nbytes, f"{others / MIB:.2f} MiB reserved by other processes on this GPU")
            self.ledger.mine(record)["reserved_bytes"] = reserved
        return reserved

    def _oom(self, nbytes: int, what: str) -> Exception:
        import torch

        return torch.cuda.OutOfMemoryError(
            f"CUDA out of memory (simulated device). Tried to allocate {nbytes / MIB:.2f} MiB. "
            f"Device has a total capacity of {self.total_bytes / MIB:.2f} MiB, {what}, of which "
            f"{self._allocated / MIB:.2f} MiB is allocated by PyTorch in this process."
        )

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` (they stay reserved in the cache until empty_cache)."""
        with self._lock:
            self._allocated = max(0, self._allocated - nbytes)

    @contextmanager
    def transient(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the duration of a block: a forward's activations."""
        self.allocate(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)


_current: SimDevice | None = None


def configure(total_bytes: int, ledger: DeviceLedger | None = None) -> SimDevice:
    """Create this process's simulated device (replacing any previous one) and return it; with a
    `ledger`, the device is the simulated GPU that ledger describes, shared with its other processes."""
    global _current
    _current = SimDevice(total_bytes, ledger)
    return _current


def current() -> SimDevice:
    """This process's simulated device. Raises RuntimeError when `configure` was not called."""
    if _current is None:
        raise RuntimeError("the simulated device is not configured (worker.simdevice.configure)")
    return _current
