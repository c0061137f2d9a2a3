"""The physical limit: the model's own throughput in one process, batched forwards in a tight
loop with preprocessing included (worker/models/minilm.py's decode + collate + forward: tokenise,
pad, BERT, pool, normalise, copy to numpy), at batch sizes 1..64 over the shipped corpus. No server can
pass it on this machine; every serving figure is also given as a fraction of it.

Run it in its own process (`python -m bench physical`) so that torch's threads and memory do
not share the load client's process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
TRUNCATE = {"truncate": True}  # as the served model read long texts before the length policy: cut to the window


def _measure(backend: object, texts: Sequence[str], batch_size: int, seconds: float) -> dict[str, object]:
    cycle = itertools.cycle(texts)
    batch_ms: list[float] = []
    items = 0
    started = time.perf_counter()
    min_forwards = max(3, -(-len(texts) // batch_size))  # every size sees the whole corpus once
    while time.perf_counter() - started < seconds or len(batch_ms) < min_forwards:
        batch = [next(cycle) for _ in range(batch_size)]
        t0 = time.perf_counter()
        backend.forward(backend.collate(backend.decode(batch, TRUNCATE)))  # type: ignore[attr-defined]
        batch_ms.append((time.perf_counter() - t0) * 1000)
        items += batch_size
    elapsed_s = sum(batch_ms) / 1000
    return {
        "batch_size": batch_size,
        "forwards": len(batch_ms),
        "items_per_s": round(items / elapsed_s, 2),
        "batch_p50_ms": round(float(np.percentile(batch_ms, 50)), 2),
        "batch_mean_ms": round(float(np.mean(batch_ms)), 2),
    }


def measure_physical_limit(
    texts: Sequence[str], *, torch_threads: int, seconds_per_size: float, batch_sizes: Sequence[int] = BATCH_SIZES
) -> list[dict[str, object]]:
    """One record per batch size: items/s, p50 and mean ms per batch (decode + collate + forward).

    Loads minilm on the CPU with `torch_threads` intra-op threads and warms it up first.
    Every size starts at the corpus' first sentence and runs over all of it at least once (and for
    at least `seconds_per_size`), so sizes see the same text mix as the load generator.
    """
    import torch

    from vramguard.shared.models import ModelConfig
    from vramguard.worker.models.minilm import MiniLMBackend

    torch.set_num_threads(torch_threads)
    backend = MiniLMBackend(ModelConfig(), "cpu")
    backend.load()
    for size in (1, max(batch_sizes)):
        backend.forward(backend.collate(backend.decode(list(itertools.islice(itertools.cycle(texts), size)), TRUNCATE)))
    return [
        {"suite": "physical", "torch_threads": torch_threads, **_measure(backend, texts, size, seconds_per_size)}
        for size in batch_sizes
    ]
