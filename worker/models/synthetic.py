"""`synthetic`: a test and benchmark model. Each output is its input, unchanged, after a
sleep of params.batch_ms + params.item_ms * batch_size per forward. It sleeps instead of
computing so that many synthetic workers do not compete for the CPU."""

from __future__ import annotations

import time
from collections.abc import Sequence

from shared.errors import ModelError
from shared.models import ModelConfig

KNOWN_PARAMS = frozenset({"batch_ms", "item_ms"})


class SyntheticBackend:
    """Echo backend; params (ms): batch_ms (fixed cost per forward), item_ms (cost per item)."""

    name = "synthetic"

    def __init__(self, config: ModelConfig, device: str) -> None:
        unknown = set(config.params) - KNOWN_PARAMS
        if unknown:
            raise ValueError(f"synthetic: unknown params {sorted(unknown)}; known: {sorted(KNOWN_PARAMS)}")
        self.device = device
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
