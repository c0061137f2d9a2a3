"""Helpers of scripts/gpu_check.sh (needs a CUDA GPU; torchvision for `resnet`).

    python scripts/gpu_check.py resnet [--total-bytes N]   profile torchvision ResNet-50 in fp16
    python scripts/gpu_check.py load --url URL --model minilm -n 500
        fire N concurrent requests, then print each worker's memory from its heartbeat,
        the OOM count and the requests lost (must be 0)
    python scripts/gpu_check.py shares --url URL --model minilm --workers 2
        after `load` on several workers of one GPU: their budgets add up, no OOM
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WATERMARK = 0.8  # gpu_check.sh's stack of several workers runs at the default watermark


class ResNet50Backend:
    """torchvision ResNet-50, random weights, fp16: enough for memory and speed."""

    name = "resnet50"
    max_item_cost = 1

    def __init__(self, device: str = "cuda") -> None:
        self.device = device
        self.model: object = None

    def load(self) -> None:
        import torch
        import torchvision

        self.model = torchvision.models.resnet50(weights=None).half().to(self.device).eval()
        self._torch = torch

    def decode(self, inputs: list[object]) -> list[object]:
        return list(inputs)

    def item_cost(self, item: object) -> int:
        return 1

    def sample_item(self, cost: int) -> object:
        return self._torch.randn(3, 224, 224, dtype=self._torch.float16)

    def collate(self, items: Sequence[object]) -> object:
        return self._torch.stack(list(items)).to(self.device)  # type: ignore[arg-type]

    def forward(self, batch: object) -> object:
        with self._torch.inference_mode():
            return self.model(batch).float().cpu()  # type: ignore[operator]

    def split(self, outputs: object, n_items: int) -> list[object]:
        return list(outputs)  # type: ignore[call-overload]

    def encode(self, item_output: object) -> object:
        return item_output

    def example_inputs(self) -> list[object]:
        return [self.sample_item(1), self.sample_item(1)]


def profile_resnet(total_bytes: int | None, cap: int) -> dict[str, object]:
    from vramguard.shared.models import ModelConfig
    from vramguard.shared.settings import Settings
    from vramguard.worker.execute import run_batch
    from vramguard.worker.memory import start_budget

    backend = ResNet50Backend()
    settings = Settings.from_env()  # the placement of this process: CUDA_VISIBLE_DEVICES, VRAMGUARD_MEMORY_SHARE
    budget = start_budget(
        backend, settings, ModelConfig(max_batch_size=cap),
        warm_up=lambda: run_batch(backend, backend.example_inputs(), cap), total_bytes=total_bytes, register=False,
    )
    return {"model": "resnet50-fp16", "device": "cuda", **budget.plan.as_dict()}


async def fire(url: str, model: str, n: int) -> None:
    import httpx

    texts = [f"short text {i}" if i % 8 else " ".join(["long"] * 300) for i in range(n)]
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(text: str) -> int:
            try:
                return (await client.post(f"/v1/models/{model}/infer", json={"inputs": [text]})).status_code
            except httpx.HTTPError:
                return -1

        statuses = await asyncio.gather(*(one(t) for t in texts))
        await asyncio.sleep(2)  # one more heartbeat carries the final counters
        workers = (await client.get(f"/v1/models/{model}")).json()["workers"]
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    lost = sum(c for s, c in counts.items() if s not in (200, 413))
    print(f"requests: {n}  statuses: {counts}  requests lost: {lost}")
    for worker_id, beat in workers.items():
        peak, budget = int(beat["mem_peak_bytes"]), int(beat["mem_budget_bytes"])
        print(f"worker {worker_id}: gpu {beat['gpu']} {beat['gpu_uuid']} share {beat['memory_share']} | context "
              f"{beat['plan_context_bytes']} weights {beat['plan_weights_bytes']} fixed {beat['plan_fixed_bytes']} "
              f"per_token {beat['plan_per_token_bytes']} | planned batch {beat['plan_batch_size']} items / "
              f"{beat['plan_batch_tokens']} tokens | peak allocated {peak} vs budget {budget} "
              f"({'OK' if peak <= budget else 'OVER'}) | oom_events {beat['oom_events']} "
              f"batch_splits {beat['batch_splits']} adaptive_batch_cap {beat['adaptive_batch_cap']}")
    sys.exit(1 if lost else 0)


def shares_add_up(url: str, model: str, expected: int) -> None:
    """Workers sharing one GPU: `expected` of them live, no OOM, and their budgets add up to at
    most the watermark x the GPU's total (each heartbeat's mem_budget_bytes, mem_total_bytes).
    Exits 1 otherwise."""
    import httpx

    workers = httpx.get(f"{url}/v1/models/{model}", timeout=10).json()["workers"]
    budgets = sum(int(b["mem_budget_bytes"]) for b in workers.values())
    total = max((int(b["mem_total_bytes"]) for b in workers.values()), default=0)
    ooms = sum(int(b["oom_events"]) for b in workers.values())
    ok = len(workers) == expected and ooms == 0 and budgets <= WATERMARK * total
    print(f"{len(workers)} of {expected} workers on one GPU: budgets add up to {budgets} bytes of "
          f"{WATERMARK} x {total} = {WATERMARK * total:.0f}; OOM events {ooms} -> {'OK' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    resnet = sub.add_parser("resnet")
    resnet.add_argument("--total-bytes", type=int)
    resnet.add_argument("--cap", type=int, default=256)
    load = sub.add_parser("load")
    load.add_argument("--url", required=True)
    load.add_argument("--model", default="minilm")
    load.add_argument("-n", type=int, default=500)
    shares = sub.add_parser("shares")  # after `load` on a stack of several workers on one GPU
    shares.add_argument("--url", required=True)
    shares.add_argument("--model", default="minilm")
    shares.add_argument("--workers", type=int, required=True)
    args = parser.parse_args()
    if args.command == "resnet":
        from vramguard.worker.profile import render_table

        result = profile_resnet(args.total_bytes, args.cap)
        print(render_table(result))
        print(json.dumps(result))
    elif args.command == "shares":
        shares_add_up(args.url, args.model, args.workers)
    else:
        asyncio.run(fire(args.url, args.model, args.n))


if __name__ == "__main__":
    main()
