"""`synthetic`: a test and benchmark model. Each output is its input, unchanged, after a
sleep of params.batch_ms + params.item_ms * batch_size per forward. It sleeps instead of
computing so that many synthetic workers do not compete for the CPU.

With Settings.fault_injection on (tests and demos only), an input {"fault": KIND} breaks the
forward it is in, the way real failures do:
    "raise"       the model raises RuntimeError (a model_error for that item)
    "exit"        the process dies at once, mid-batch (os._exit(137), as after SIGKILL)
    "cuda_error"  RuntimeError("CUDA error: an illegal memory access was encountered")
    "oom"         torch.cuda.OutOfMemoryError
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from shared.errors import ModelError
from shared.models import ModelConfig

KNOWN_PARAMS = frozenset({"batch_ms", "item_ms"})


class SyntheticBackend:
    """Echo backend; params (ms): batch_ms (fixed cost per forward), item_ms (cost per item)."""

    name = "synthetic"

    def __init__(self, config: ModelConfig, device: str, *, fault_injection: bool = False) -> None:
        unknown = set(config.params) - KNOWN_PARAMS
        if unknown:
            raise ValueError(f"synthetic: unknown params {sorted(unknown)}; known: {sorted(KNOWN_PARAMS)}")
        self.device = device
        self.fault_injection = fault_injection
        self.batch_ms = config.params.get("batch_ms", 0.0)
        self.item_ms = config.params.get("item_ms", 0.0)

    def load(self) -> None:
        pass

    def decode(self, inputs: list[object]) -> list[object]:
        return list(inputs)

    def item_cost(self, item: object) -> int:
        return 1

    def collate(self, items: Sequence[object]) -> object:
        return list(items)

    def forward(self, batch: object) -> object:
        assert isinstance(batch, list)
        time.sleep((self.batch_ms + self.item_ms * len(batch)) / 1000)
        if self.fault_injection:
            for item in batch:
                if isinstance(item, dict) and "fault" in item:
                    inject_fault(str(item["fault"]))
        return batch

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, list)
        if len(outputs) != n_items:
            raise ModelError(f"synthetic returned {len(outputs)} outputs for {n_items} items")
        return outputs

    def encode(self, item_output: object) -> object:
        return item_output

    def example_inputs(self) -> list[object]:
        return [[0.0, 1.0], "warmup"]


def inject_fault(kind: str) -> None:
    """Fail the way `kind` names (see the module docstring). Raises; "exit" never returns."""
    if kind == "exit":
        os._exit(137)
    if kind == "cuda_error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if kind == "oom":
        import torch

        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected fault)")
    raise RuntimeError(f"injected fault {kind!r}")
