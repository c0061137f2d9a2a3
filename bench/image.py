"""The image model's row: `efficientnet` served by vramguard at concurrency 1 and 32 (one photo,
base64 in JSON, per request) against its in-process ceiling: decode + collate + forward +
encode of worker/models/efficientnet.py in a tight loop in one process, at batch sizes up to
the served one; the best of them is the ceiling (a convolution net on the CPU can run fewer
items per second at batch 16 than at batch 1). Run the ceiling in its own process
(`python -m bench.image`), as bench/physical.py is.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

IMAGE_CONCURRENCIES = (1, 32)
IMAGE_BATCH_SIZE = 16
LIMIT_BATCH_SIZES = (1, 4, IMAGE_BATCH_SIZE)


def photo_bytes() -> bytes:
    """matplotlib's sample photo (grace_hopper.jpg, 512x600 JPEG): what every request sends."""
    from matplotlib import cbook

    return Path(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).read_bytes()


def measure_limits(torch_threads: int, seconds: float) -> Iterator[dict[str, object]]:
    """Items/s of decode + collate + forward + encode at each of LIMIT_BATCH_SIZES, one record
    each, after a warm-up forward at that size; the model is loaded once."""
    import torch

    from vramguard.shared.models import ModelConfig
    from vramguard.worker.models.efficientnet import EfficientNetBackend

    torch.set_num_threads(torch_threads)
    backend = EfficientNetBackend(ModelConfig(), "cpu")
    backend.load()
    for batch_size in LIMIT_BATCH_SIZES:
        blobs: list[object] = [photo_bytes()] * batch_size
        backend.forward(backend.collate(backend.decode(blobs, {})))
        forwards, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds or forwards < 3:
            items = backend.decode(blobs, {})
            outputs = backend.split(backend.forward(backend.collate(items)), batch_size)
            [backend.encode(item, out) for item, out in zip(items, outputs, strict=True)]
            forwards += 1
        elapsed_s = time.perf_counter() - started
        yield {"suite": "image-limit", "torch_threads": torch_threads, "batch_size": batch_size,
               "forwards": forwards, "items_per_s": round(forwards * batch_size / elapsed_s, 2)}


def image(cfg: object) -> Iterator[dict[str, object]]:
    """The in-process ceiling (one record per batch size), then vramguard serving efficientnet at
    concurrency 1 and 32; '% of limit' is against the best batch size."""
    from bench.services import ROOT, VramguardService
    from bench.suites import BenchConfig, measure

    assert isinstance(cfg, BenchConfig)
    argv = [sys.executable, "-m", "bench.image", "--torch-threads", str(cfg.torch_threads),
            "--seconds", str(max(cfg.physical_seconds * 3, 1.0))]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True, env=dict(os.environ))
    limits = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    yield from limits
    best = max(float(limit["items_per_s"]) for limit in limits)
    body = {"inputs": [base64.b64encode(photo_bytes()).decode()]}
    settings: dict[str, object] = {"torch_threads": cfg.torch_threads,
                                   "models__efficientnet__max_batch_size": IMAGE_BATCH_SIZE}
    service = VramguardService("image", "efficientnet", 1, settings, cfg.log_dir / "image")
    service.start()
    try:
        for concurrency in IMAGE_CONCURRENCIES:
            record = measure(service, cfg, concurrency, bodies=lambda: body, suite="image",
                             config=f"efficientnet (batch {IMAGE_BATCH_SIZE}, 5 ms)")
            record["pct_of_limit"] = round(100 * float(record["items_per_s"]) / best, 1)
            yield record
    finally:
        service.stop()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.image", description=__doc__)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    for record in measure_limits(args.torch_threads, args.seconds):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
