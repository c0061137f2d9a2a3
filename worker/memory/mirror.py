"""The allocation mirror: a real model runs on the CPU while every tensor it creates and frees is
mirrored, in order and with its size, into the simulated CUDA caching allocator
(worker/memory/simdevice.py), so the budget, the profile, the soft guard, the OOM split and the KV
plan run against the model's own op sequence on a machine without a GPU. The model does not know:
the worker's model threads (worker/modelthreads.py) run every call into the backend inside
`scope()`, and the start (worker/memory/budget.py) installs the mirror when the device is "sim".

How: a TorchDispatchMode sees each aten op's outputs; each output's untyped storage not seen
before is one allocation of its nbytes, freed when the storage dies (a weakref finalizer, so a
view or an in-place result is no new allocation). Storages the model made before the mode saw
them (weights loaded from a file and assigned as parameters) are adopted after `load`: every
parameter and buffer of every live nn.Module counts where it lives, on the device.

Where CUDA allocates differently from the CPU path, the mirror adds what CUDA would take, erring
on the side of more (docs/concepts/simulated-gpu.md has the formulas):
- scaled dot-product attention: the math path's scores and probabilities, 2 x B x H x L x S x
  element size, held for the op (the fused flash and memory-efficient kernels take less);
- cuBLAS: a workspace of CUBLAS_WORKSPACE_BYTES taken at the first matrix product and kept for
  the process's life, as PyTorch keeps one per handle and stream;
- cuDNN convolutions: a workspace as large as the op's output, held for the op (a heuristic: the
  algorithm cuDNN picks decides the real figure; scripts/gpu_check.sh compares);
- the CUDA context and lazily loaded kernel modules live outside the allocator: the simulated
  device's context_bytes and module_bytes (Settings.sim_context_bytes / sim_module_bytes).
Host-side tensors the model makes inside a mirrored call count as device memory too (more, not less).
"""

from __future__ import annotations

import gc
import math
import threading
import types
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vramguard.worker.memory.simdevice import Block, SimDevice

__all__ = ["CUBLAS_WORKSPACE_BYTES", "AllocationMirror", "active", "install", "scope", "uninstall"]

MIB = 1024 * 1024
# PyTorch's default cuBLAS workspace per handle and stream (aten/src/ATen/cuda/CublasHandlePool.cpp,
# getChosenWorkspaceSize): 4096 KiB x 8 = 32 MiB on Hopper (sm90), 4096 KiB x 2 + 16 KiB x 8 elsewhere;
# the larger one, since the simulated device has no architecture.
CUBLAS_WORKSPACE_BYTES = 32 * MIB
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "_addmm_activation",
                      "addbmm", "dot", "vdot"})
_CONVOLUTIONS = frozenset({"convolution", "_convolution", "conv2d", "conv1d", "conv3d", "cudnn_convolution",
                           "mkldnn_convolution", "_slow_conv2d_forward", "conv_depthwise2d"})


class _Tracked:
    """One mirrored storage: its block on the simulated device and its size (bytes)."""

    __slots__ = ("block", "nbytes")

    def __init__(self, block: Block, nbytes: int) -> None:
        self.block = block
        self.nbytes = nbytes


class AllocationMirror:
    """Mirrors the storages of the tensors that the ops run under `scope()` create into `device`.
    Thread-safe: the table is changed under a lock; frees reach the device through
    SimDevice.release_later, since a finalizer may run in the middle of an allocation."""

    def __init__(self, device: SimDevice) -> None:
        self.device = device
        self._table: dict[int, _Tracked] = {}  # storage data pointer -> its block
        self._lock = threading.Lock()
        self._workspace: Block | None = None  # cuBLAS's, once taken
        self._depth = threading.local()

    def track(self, tensor: torch.Tensor) -> None:
        """Mirror `tensor`'s storage when it is new (or grew: a resize is a new allocation and a
        free). Raises torch.cuda.OutOfMemoryError when the simulated device refuses it."""
        if tensor.device.type != "cpu" or tensor.is_sparse or tensor.is_nested:
            return
        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or pointer == 0:
            return
        with self._lock:
            known = self._table.get(pointer)
            if known is not None and known.nbytes >= nbytes:
                return
        block = self.device.allocate(nbytes)
        with self._lock:
            if known is not None:  # resized in place: the old block goes, the new one stays
                self.device.release_later(known.block)
                known.block, known.nbytes = block, nbytes
                return
            entry = _Tracked(block, nbytes)
            self._table[pointer] = entry
        weakref.finalize(storage, self._forget, pointer, entry)

    def _forget(self, pointer: int, entry: _Tracked) -> None:
        with self._lock:
            if self._table.get(pointer) is entry:
                del self._table[pointer]
        self.device.release_later(entry.block)

    def adopt_modules(self, root: object) -> int:
        """Mirror every parameter and buffer not mirrored yet of the nn.Modules that `root` (the
        backend) holds, however deep: weights a checkpoint loader assigned without an op the mode
        saw. Returns the bytes adopted."""
        before = self.device.memory_allocated()
        for module in _modules_under(root):
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                self.track(tensor.detach())
        return self.device.memory_allocated() - before

    def workspace_bytes(self, name: str, args: tuple[Any, ...], outputs: list[torch.Tensor]) -> int:
        """What CUDA's kernel for op `name` takes beside its outputs for the op's duration (bytes);
        takes cuBLAS's lasting workspace at the first matrix product."""
        if name in _MATMULS and self._workspace is None:
            self._workspace = self.device.allocate(CUBLAS_WORKSPACE_BYTES)
        if "scaled_dot_product" in name and len(args) >= 2:
            query, key = args[0], args[1]
            if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2:
                heads = math.prod(query.shape[:-2])
                return 2 * heads * query.shape[-2] * key.shape[-2] * query.element_size()
        if name in _CONVOLUTIONS:
            return sum(t.untyped_storage().nbytes() for t in outputs[:1])
        return 0

    def scope(self) -> AbstractContextManager[None]:
        """The mirror's dispatch mode on this thread (re-entering it is a no-op)."""
        if getattr(self._depth, "n", 0):
            return nullcontext()
        return self._scoped()

    @contextmanager
    def _scoped(self) -> Iterator[None]:
        self._depth.n = 1
        try:
            with _MirrorMode(self):
                yield
        finally:
            self._depth.n = 0


_WALK_LIMIT = 1_000_000  # objects visited from a backend at most: a bound, never reached by a model


def _modules_under(root: object) -> list[torch.nn.Module]:
    """The nn.Modules reachable from `root` through containers and instance attributes (gc's
    referents), submodules included; modules, classes and functions are not walked into."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < _WALK_LIMIT:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if issubclass(type(obj), torch.nn.Module):  # type(), not isinstance: no lazy proxy is woken
            for module in obj.modules():  # type: ignore[attr-defined]
                if module is obj or id(module) not in seen:
                    seen.add(id(module))
                    found.append(module)
            continue
        if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes,
                            int, float, torch.Tensor)):
            continue
        stack.extend(gc.get_referents(obj))
    return found


class _MirrorMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, mirror: AllocationMirror) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.mirror = mirror

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if not self.mirror.device.modules_loaded:
            self.mirror.device.launch()  # the first kernel loads the modules (lazy loading), outside the allocator
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for tensor in outputs:
            self.mirror.track(tensor)
        extra = self.mirror.workspace_bytes(func.overloadpacket.__name__, args, outputs)
        if extra:  # held beside the outputs, then given back: the kernel's scratch memory
            self.mirror.device.release(self.mirror.device.allocate(extra))
        return out


_active: AllocationMirror | None = None


def install(device: SimDevice) -> AllocationMirror:
    """Mirror the tensors of every later `scope()` into `device` (this process's simulated GPU)."""
    global _active
    _active = AllocationMirror(device)
    return _active


def uninstall() -> None:
    """Stop mirroring (tests that build several devices in one process)."""
    global _active
    _active = None


def active() -> AllocationMirror | None:
    """The installed mirror, or None (not on a simulated device, or a model that simulates its own memory)."""
    return _active


def scope() -> AbstractContextManager[None]:
    """The context every call into the backend runs in: the mirror's mode when one is installed."""
    mirror = _active
    return mirror.scope() if mirror is not None else nullcontext()
