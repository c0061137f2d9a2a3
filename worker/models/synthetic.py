"""`synthetic`: a test and benchmark model. Each output is its input, unchanged, after a
sleep of params.batch_ms + params.item_ms * the batch's padded cost per forward. It sleeps
instead of computing so that many synthetic workers do not compete for the CPU.

With params.output_dim N > 0, each output is instead a float32 row of N unit-norm values (the
same row for every input), the shape minilm answers (384), so rendering real replies is measured
with no compute behind it.

Cost: 1 per input, unless params.max_tokens > 1: then a string costs its word count (truncated
at max_tokens, as minilm truncates at its window) and a batch costs items x its longest item.

On the simulated device (device "sim", worker/memory/simdevice.py) it declares memory, so the planner
has something real to measure: params.weights_mib held from load, and per forward
params.fixed_mib + params.item_mib * padded cost, which raises the real
torch.cuda.OutOfMemoryError past the device's limit. The defaults on a 512 MiB device at
watermark 0.8 allow floor((409.6 - 128 - 16) / 8) = 33 items, well below the cap of 64.

With Settings.fault_injection on (tests and demos only), an input {"fault": KIND} breaks the
forward it is in, the way real failures do:
    "raise"       the model raises RuntimeError (a model_error for that item)
    "exit"        the process dies at once, mid-batch (os._exit(137), as after SIGKILL)
    "cuda_error"  RuntimeError("CUDA error: an illegal memory access was encountered")
    "oom"         torch.cuda.OutOfMemoryError
    "leak"        (sim) the forward keeps all free device memory for good: every later forward OOMs
    "hang"        the forward never returns (a stuck kernel or a deadlock; worker/health/hang.py ends it)
    "internal"    not the forward: costing the input raises, a bug in the worker's batch task
                  (worker/batch/batch_errors.py answers 500 internal)
    "decode_hang" not the forward: decoding the request never returns (a stuck image decoder)
and an input {"alloc_mib": N} makes its forward take N MiB more than its cost says (sim), the
way an input the cost model mispredicts does. Settings.fault_cuda_error_file is a one-shot hook:
when that file exists, the next forward deletes it and raises a CUDA error.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np

from vramguard.shared.errors import ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.memory import simdevice
from vramguard.worker.memory.simdevice import SimDevice

MIB = 1024 * 1024
DEFAULT_PARAMS = {"batch_ms": 0.0, "item_ms": 0.0, "weights_mib": 128.0, "fixed_mib": 16.0, "item_mib": 8.0,
                  "max_tokens": 1.0, "output_dim": 0.0}
KNOWN_PARAMS = frozenset(DEFAULT_PARAMS)


class SyntheticBackend:
    """Echo backend. Params: batch_ms, item_ms (sleep per forward and per unit of padded cost),
    weights_mib, fixed_mib, item_mib (simulated memory), max_tokens (1: fixed-size inputs),
    output_dim (0: echo the input; N: a float32 row [N] per input)."""

    name = "synthetic"
    simulates_memory = True  # on "sim" it declares its memory itself: no allocation mirror (worker/memory/mirror.py)

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        unknown = set(config.params) - KNOWN_PARAMS
        if unknown:
            raise ValueError(f"synthetic: unknown params {sorted(unknown)}; known: {sorted(KNOWN_PARAMS)}")
        p = {**DEFAULT_PARAMS, **config.params}
        if p["max_tokens"] < 1:
            raise ValueError("synthetic: params.max_tokens must be >= 1")
        self.device = device
        self.fault_injection = settings.fault_injection
        self.fault_file = Path(settings.fault_cuda_error_file) if settings.fault_cuda_error_file else None
        self.batch_ms, self.item_ms = p["batch_ms"], p["item_ms"]
        self.weights_bytes, self.fixed_bytes = int(p["weights_mib"] * MIB), int(p["fixed_mib"] * MIB)
        self.unit_bytes = p["item_mib"] * MIB
        self._max_tokens = int(p["max_tokens"])
        row = np.random.default_rng(0).standard_normal(int(p["output_dim"])).astype(np.float32)
        self._row = row / max(float(np.linalg.norm(row)), 1e-9) if row.size else None
        self._sim: SimDevice | None = None

    def load(self) -> None:
        if self.device == "sim":
            self._sim = simdevice.current()
            self._sim.allocate(self.weights_bytes)

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        if self.fault_injection and any(isinstance(i, dict) and i.get("fault") == "decode_hang" for i in inputs):
            inject_fault("hang")
        return list(inputs)

    @property
    def max_item_cost(self) -> int:
        return self._max_tokens

    def item_cost(self, item: object) -> int:
        if self.fault_injection and isinstance(item, dict) and item.get("fault") == "internal":
            raise RuntimeError("injected bug outside the forward")
        if self._max_tokens > 1 and isinstance(item, str):
            return max(1, min(len(item.split()), self._max_tokens))
        return 1

    def sample_item(self, cost: int) -> object:
        return " ".join(["w"] * cost) if self._max_tokens > 1 else 0.0

    def collate(self, items: Sequence[object]) -> object:
        return list(items)

    def forward(self, batch: object) -> object:
        assert isinstance(batch, list)
        cost = len(batch) * max((self.item_cost(item) for item in batch), default=0)
        self._check_fault_file()
        faults = [str(i["fault"]) for i in batch if isinstance(i, dict) and "fault" in i]
        faults = faults if self.fault_injection else []
        with self._simulated_memory(batch, cost):
            time.sleep((self.batch_ms + self.item_ms * cost) / 1000)
            for kind in faults:
                if kind != "leak":
                    inject_fault(kind)
        if "leak" in faults and self._sim is not None:
            self._sim.fill()
        if self._row is not None:
            return list(np.tile(self._row, (len(batch), 1)))
        return batch

    def _simulated_memory(self, batch: list[object], cost: int) -> AbstractContextManager[None]:
        if self._sim is None:
            return nullcontext()
        extra = sum(float(i.get("alloc_mib", 0)) for i in batch if isinstance(i, dict)) if self.fault_injection else 0
        return self._sim.transient(int(self.fixed_bytes + self.unit_bytes * cost + extra * MIB))

    def _check_fault_file(self) -> None:
        if self.fault_file is not None and self.fault_file.exists():
            self.fault_file.unlink(missing_ok=True)
            inject_fault("cuda_error")

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, list)
        if len(outputs) != n_items:
            raise ModelError(f"synthetic returned {len(outputs)} outputs for {n_items} items")
        return outputs

    def encode(self, item: object, output: object) -> object:
        return output

    def example_inputs(self) -> list[object]:
        return [[0.0, 1.0], "warmup"]


def inject_fault(kind: str) -> None:
    """Fail the way `kind` names (see the module docstring). Raises; "exit" never returns."""
    if kind == "exit":
        os._exit(137)
    if kind == "hang":
        threading.Event().wait()  # nothing ever sets it
    if kind == "cuda_error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if kind == "oom":
        import torch

        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected fault)")
    raise RuntimeError(f"injected fault {kind!r}")
