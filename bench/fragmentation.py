"""Fragmentation of the caching allocator under mixed text lengths, on the simulated device: a
MiniLM-shaped encoder (6 layers, hidden 384, 12 heads, FFN 1536, fp32; weights in many tensors, as
a checkpoint loads them) planned and served inside a memory share of 0.25 of a 512 MiB simulated
GPU, fed batches of random size from bench/corpus.txt (a few words to a paragraph), with and
without expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, modelled in
worker/memory/simalloc.py). It reports the allocator cap, the highest reserved memory, the highest
allocated, what the allocator held beyond the allocated peak (fragmentation and cache), and OOM
events. With --model minilm the real model runs instead, on the CPU, its own allocations mirrored
into the simulated allocator (worker/memory/mirror.py), inside a share of 0.4 of 512 MiB (its
weights and cuBLAS's workspace would not fit 0.25).

    python -m bench.fragmentation [--forwards 20000] [--seed 0] [--model encoder|minilm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bench.corpus import CORPUS_PATH
from vramguard.shared.models import ModelConfig, ModelOverrides
from vramguard.shared.settings import Settings
from vramguard.worker.batch.execute import run_batch
from vramguard.worker.memory import mirror
from vramguard.worker.memory.budget import MemoryBudget, start_budget
from vramguard.worker.memory.simdevice import Block, SimDevice
from vramguard.worker.models import create_backend
from vramguard.worker.models.synthetic import SyntheticBackend

MIB = 1024 * 1024
FP32 = 4
VOCAB, HIDDEN, HEADS, FFN, LAYERS, WINDOW = 30522, 384, 12, 1536, 6, 64
MAX_BATCH = 32


class SimEncoder(SyntheticBackend):
    """The synthetic text model with an encoder's allocations on the simulated device: weights as
    separate tensors, and per forward the activations each layer creates and frees in turn."""

    def load(self) -> None:
        super().load()  # weights_mib 0: takes the device
        assert self._sim is not None
        self.weights = [self._sim.allocate(VOCAB * HIDDEN * FP32)]
        for _ in range(LAYERS):
            self.weights += [self._sim.allocate(HIDDEN * HIDDEN * FP32) for _ in range(4)]
            self.weights += [self._sim.allocate(HIDDEN * FFN * FP32) for _ in range(2)]

    def forward(self, batch: object) -> object:
        assert isinstance(batch, list) and self._sim is not None
        tokens = max(self.item_cost(item) for item in batch)
        with _activations(self._sim, len(batch), tokens):
            return batch


@contextmanager
def _activations(sim: SimDevice, b: int, t: int) -> Iterator[None]:
    sim.launch()
    x = sim.allocate(b * t * HIDDEN * FP32)
    try:
        for _ in range(LAYERS):
            x = _layer(sim, x, b, t)
        pooled = sim.allocate(b * HIDDEN * FP32)
        sim.release(pooled)
        yield
    finally:
        sim.release(x)


def _layer(sim: SimDevice, x: Block, b: int, t: int) -> Block:
    act = b * t * HIDDEN * FP32
    qkv = sim.allocate(3 * act)
    scores = sim.allocate(b * HEADS * t * t * FP32)
    probs = sim.allocate(b * HEADS * t * t * FP32)
    sim.release(scores)
    context = sim.allocate(act)
    sim.release(probs)
    sim.release(qkv)
    attended = sim.allocate(act)
    sim.release(context)
    inner = sim.allocate(b * t * FFN * FP32)
    out = sim.allocate(act)
    sim.release(inner)
    sim.release(attended)
    sim.release(x)
    return out


def run(expandable: bool, forwards: int, seed: int = 0, model: str = "encoder") -> dict[str, object]:
    """Plan the encoder (or the real minilm, mirrored) in its share, then serve `forwards` random
    batches of corpus lines. Returns the figures (bytes, counts)."""
    previous = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        return _serve_minilm(forwards, seed) if model == "minilm" else _serve(forwards, seed)
    finally:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if previous is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = previous


def _serve_minilm(forwards: int, seed: int) -> dict[str, object]:
    settings = Settings(model="minilm", device="sim", sim_memory_bytes=512 * MIB, memory_share=0.4,
                        models={"minilm": ModelOverrides(max_batch_size=MAX_BATCH)})
    config = settings.model_config_for("minilm")
    backend = create_backend(settings, "sim")
    budget = start_budget(backend, settings, config, register=False,
                          warm_up=lambda: run_batch(backend, backend.decode(backend.example_inputs(), {}), MAX_BATCH))
    return _figures(budget, lambda items: run_batch(backend, backend.decode(items, {}), MAX_BATCH, budget=budget),
                    forwards, seed)


def _figures(budget: MemoryBudget, serve: Callable[[list[object]], object], forwards: int,
             seed: int) -> dict[str, object]:
    lines = CORPUS_PATH.read_text().splitlines()
    rng = random.Random(seed)
    started = time.monotonic()
    with mirror.scope():  # as the worker's model threads run every call (a no-op for the encoder)
        for _ in range(forwards):
            serve([rng.choice(lines) for _ in range(rng.randint(1, MAX_BATCH))])
    device = budget.accounting.device  # type: ignore[attr-defined]
    return {
        "expandable_segments": device.alloc.expandable_segments, "forwards": forwards,
        "seconds": round(time.monotonic() - started, 1),
        "cap_bytes": budget.plan.cap_bytes, "max_reserved_bytes": device.max_memory_reserved(),
        "max_allocated_bytes": device.max_memory_allocated(),
        "held_beyond_allocated_peak_bytes": device.max_memory_reserved() - device.max_memory_allocated(),
        "planned_batch_tokens": budget.plan.planned_batch_tokens, "oom_events": budget.oom_events,
        "batch_splits": budget.batch_splits,
    }


def _serve(forwards: int, seed: int) -> dict[str, object]:
    params = {"weights_mib": 0, "fixed_mib": 0, "item_mib": 0, "max_tokens": WINDOW}
    settings = Settings(model="synthetic", sim_memory_bytes=512 * MIB, memory_share=0.25,
                        models={"synthetic": ModelOverrides(max_batch_size=MAX_BATCH, params=params)})
    config = settings.model_config_for("synthetic")
    backend = SimEncoder(ModelConfig(params=params), "sim", settings)
    budget = start_budget(backend, settings, config, register=False)
    return _figures(budget, lambda items: run_batch(backend, items, MAX_BATCH, budget=budget), forwards, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forwards", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=("encoder", "minilm"), default="encoder")
    args = parser.parse_args()
    for expandable in (False, True):
        result = run(expandable, args.forwards, args.seed, args.model)
        print(json.dumps(result))
        mib = {k: round(v / MIB, 1) for k, v in result.items() if k.endswith("_bytes") and isinstance(v, int)}
        print(f"expandable_segments={expandable}: {mib} oom_events={result['oom_events']}")


if __name__ == "__main__":
    main()
