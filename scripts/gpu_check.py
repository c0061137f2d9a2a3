"""Helpers of scripts/gpu_check.sh (a CUDA GPU for `resnet` and NVML; tests run `report` against the
simulated device).

    python scripts/gpu_check.py resnet [--total-bytes N]   profile torchvision ResNet-50 in fp16
    python scripts/gpu_check.py load --url URL --model minilm -n 500
        fire N concurrent requests; PASS when no request is lost
    python scripts/gpu_check.py report --url URL --model minilm --workers 3 [--gpu 0] [--sim-ledger DIR]
        per worker of one GPU: NVML's per-process used memory vs share x total, max reserved vs
        the allocator cap, the plan's numbers, OOM events; the budgets vs watermark x total;
        PASS/FAIL per check (with --sim-ledger: a simulated GPU's ledger instead of NVML)
    python scripts/gpu_check.py calibrate [--models minilm,efficientnet,smollm2] [--batches 1,8,32] [--tokens 128]
        per shipped model and batch size: the simulated GPU's prediction (the model on the CPU, its
        allocations mirrored: worker/memory/mirror.py) beside CUDA's max_memory_reserved and NVML's
        per-process used memory for the same batch; CUDA's columns are "-" without a GPU
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
    from vramguard.worker.batch.execute import run_batch
    from vramguard.worker.memory.budget import start_budget

    backend = ResNet50Backend()
    settings = Settings.from_env()  # the placement of this process: CUDA_VISIBLE_DEVICES, VRAMGUARD_MEMORY_SHARE
    budget = start_budget(
        backend, settings, ModelConfig(max_batch_size=cap),
        warm_up=lambda: run_batch(backend, backend.example_inputs(), cap), total_bytes=total_bytes, register=False,
    )
    return {"model": "resnet50-fp16", "device": "cuda", **budget.plan.as_dict()}


async def fire(url: str, model: str, n: int) -> tuple[dict[int, int], int]:
    """`n` concurrent requests to `model` (one in 8 at the model's maximum length). Returns the count
    of each status (-1: no HTTP answer) and the requests lost (anything but 200 and 413)."""
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
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    return counts, sum(c for s, c in counts.items() if s not in (200, 413))


def nvml_used_by_pid(gpu: str) -> dict[int, int]:
    """NVML's used memory per compute process on `gpu` (an index or a UUID), in bytes."""
    from vramguard.worker.memory.accounting import _nvml_processes

    return dict(_nvml_processes(gpu))


def sim_used_by_pid(ledger_folder: Path, gpu: str) -> dict[int, int]:
    """The simulated GPU's per-process used memory (reserved + outside the allocator), from its ledger:
    what NVML shows on a real GPU (the helpers run against it on the CPU)."""
    record = json.loads((ledger_folder / f"sim-{gpu}.json").read_text())
    return {int(p["pid"]): int(p.get("reserved_bytes", 0)) + int(p.get("outside_bytes", 0))
            for p in record["processes"].values()}


def check_workers(beats: dict[str, dict[str, object]], used_by_pid: dict[int, int], expected: int,
                  watermark: float = WATERMARK) -> list[tuple[str, bool, str]]:
    """The memory promise per worker of one GPU, from their heartbeats and the device's per-process
    used memory: (check, passed, detail) for the worker count, and per worker: the device's used
    memory of its process <= share x total, its highest reserved <= its allocator cap, no OOM;
    and the workers' budgets <= watermark x total."""
    checks = [("workers live", len(beats) == expected, f"{len(beats)} of {expected}")]
    total = max((int(str(b["mem_total_bytes"])) for b in beats.values()), default=0)
    for worker_id, beat in sorted(beats.items()):
        share, pid = float(str(beat["memory_share"])), int(str(beat["pid"]))
        used = used_by_pid.get(pid)
        budget = int(share * total)
        checks.append((f"{worker_id} used <= share x total", used is not None and used <= budget,
                       f"pid {pid} uses {used} bytes of share {share:g} x {total} = {budget}"))
        cap, reserved = int(str(beat["mem_cap_bytes"])), int(str(beat["mem_max_reserved_bytes"]))
        checks.append((f"{worker_id} reserved <= cap", reserved <= cap,
                       f"max reserved {reserved} vs cap {cap} (context {beat['plan_context_bytes']}, weights "
                       f"{beat['plan_weights_bytes']}, fixed {beat['plan_fixed_bytes']}, per token "
                       f"{beat['plan_per_token_bytes']}, batch {beat['plan_batch_size']} items / "
                       f"{beat['plan_batch_tokens']} tokens)"))
        checks.append((f"{worker_id} no OOM", int(str(beat["oom_events"])) == 0, f"oom_events {beat['oom_events']}"))
    budgets = sum(int(str(b["mem_budget_bytes"])) for b in beats.values())
    checks.append(("budgets <= watermark x total", budgets <= watermark * total + 1,
                   f"{budgets} of {watermark:g} x {total}"))
    return checks


def print_checks(checks: list[tuple[str, bool, str]]) -> bool:
    """One line per check, PASS or FAIL; returns whether all passed."""
    for name, passed, detail in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    return all(passed for _name, passed, _detail in checks)


def report(url: str, model: str, expected: int, gpu: str, sim_ledger: Path | None) -> bool:
    """Print the checks of `check_workers` for the live workers of `model` (per-process memory from
    NVML, or from the simulated GPU's ledger under `sim_ledger`); returns whether all passed."""
    import httpx

    beats = httpx.get(f"{url}/v1/models/{model}", timeout=10).json()["workers"]
    used = sim_used_by_pid(sim_ledger, gpu) if sim_ledger is not None else nvml_used_by_pid(gpu)
    return print_checks(check_workers(beats, used, expected))


MIB = 1024 * 1024
CALIBRATION_COLUMNS = ("model", "batch", "tokens", "sim reserved MiB", "sim used MiB", "cuda max reserved MiB",
                       "nvml process MiB", "sim / cuda")


def calibration_row(model: str, batch: int, tokens: int, sim: tuple[int, int],
                    cuda: tuple[int, int | None] | None) -> dict[str, object]:
    """One line of the calibration table. `sim`: (max reserved, reserved + outside the allocator) of
    the simulated GPU for the batch, bytes; `cuda`: (torch.cuda.max_memory_reserved, NVML's used
    memory of the process or None where NVML does not list it), bytes, or None without a GPU."""
    row: dict[str, object] = {"model": model, "batch": batch, "tokens": tokens,
                              "sim reserved MiB": round(sim[0] / MIB, 1), "sim used MiB": round(sim[1] / MIB, 1),
                              "cuda max reserved MiB": "-", "nvml process MiB": "-", "sim / cuda": "-"}
    if cuda is not None:
        reserved, nvml = cuda
        row["cuda max reserved MiB"] = round(reserved / MIB, 1)
        row["nvml process MiB"] = round(nvml / MIB, 1) if nvml is not None else "-"
        row["sim / cuda"] = round(sim[0] / reserved, 2) if reserved else "-"
    return row


def render_calibration(rows: list[dict[str, object]]) -> str:
    """The rows as an aligned text table, CALIBRATION_COLUMNS in order."""
    cells = [list(CALIBRATION_COLUMNS)] + [[str(row[c]) for c in CALIBRATION_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(CALIBRATION_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in cells)


def _batch(backend: object, batch: int, tokens: int) -> list[object]:
    cost = min(tokens, int(getattr(backend, "max_item_cost", 1)))
    return [backend.sample_item(cost) for _ in range(batch)]  # type: ignore[attr-defined]


def measure_sim(model: str, batches: list[int], tokens: int) -> list[tuple[int, int]]:
    """Per batch size: (max reserved, reserved + outside) bytes of a simulated GPU that the model,
    run on the CPU, is mirrored into (weights adopted, then one forward per batch from an emptied cache)."""
    from vramguard.shared.settings import Settings
    from vramguard.worker.memory import mirror
    from vramguard.worker.memory.simdevice import SimDevice
    from vramguard.worker.models import create_backend

    settings = Settings(model=model, device="sim")
    device = SimDevice(64 * 1024 * MIB, context_bytes=settings.sim_context_bytes,
                       module_bytes=settings.sim_module_bytes)
    active = mirror.install(device)
    try:
        backend = create_backend(settings, "sim")
        out = []
        with active.scope():
            backend.load()
            active.adopt_modules(backend)
            for size in batches:
                device.empty_cache()
                device.reset_peak_memory_stats()
                backend.forward(backend.collate(_batch(backend, size, tokens)))
                out.append((device.max_memory_reserved(), device.max_memory_reserved() + device.outside_bytes))
        return out
    finally:
        mirror.uninstall()


def measure_cuda(model: str, batches: list[int], tokens: int) -> list[tuple[int, int | None]] | None:
    """Per batch size: (torch.cuda.max_memory_reserved, NVML's used memory of this process) bytes
    after one forward from an emptied cache; None without a GPU."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    from vramguard.shared.settings import Settings
    from vramguard.worker.models import create_backend

    backend = create_backend(Settings(model=model, device="cuda"), "cuda")
    backend.load()
    out: list[tuple[int, int | None]] = []
    for size in batches:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        backend.forward(backend.collate(_batch(backend, size, tokens)))
        torch.cuda.synchronize()
        nvml = nvml_used_by_pid(os.environ.get("CUDA_VISIBLE_DEVICES", "0") or "0").get(os.getpid())
        out.append((int(torch.cuda.max_memory_reserved()), nvml))
    return out


def calibrate(models: list[str], batches: list[int], tokens: int) -> list[dict[str, object]]:
    """The calibration rows of every model and batch size (simulated, and CUDA's where there is a GPU)."""
    rows = []
    for model in models:
        sim = measure_sim(model, batches, tokens)
        cuda = measure_cuda(model, batches, tokens)
        for i, size in enumerate(batches):
            rows.append(calibration_row(model, size, tokens, sim[i], cuda[i] if cuda is not None else None))
    return rows


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
    check = sub.add_parser("report")  # after `load`: the memory promise per worker of one GPU
    check.add_argument("--url", required=True)
    check.add_argument("--model", default="minilm")
    check.add_argument("--workers", type=int, required=True)
    check.add_argument("--gpu", default="0")
    check.add_argument("--sim-ledger", type=Path, help="read a simulated GPU's ledger instead of NVML")
    calib = sub.add_parser("calibrate")  # the simulated prediction beside CUDA's and NVML's
    calib.add_argument("--models", default="minilm,efficientnet,smollm2")
    calib.add_argument("--batches", default="1,8,32")
    calib.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if args.command == "calibrate":
        rows = calibrate(args.models.split(","), [int(b) for b in args.batches.split(",")], args.tokens)
        print(render_calibration(rows))
        print(json.dumps(rows))
    elif args.command == "resnet":
        from vramguard.worker.memory.profile import render_table

        result = profile_resnet(args.total_bytes, args.cap)
        print(render_table(result))
        print(json.dumps(result))
    elif args.command == "report":
        sys.exit(0 if report(args.url, args.model, args.workers, args.gpu, args.sim_ledger) else 1)
    else:
        counts, lost = asyncio.run(fire(args.url, args.model, args.n))
        print(f"requests: {args.n}  statuses: {counts}  requests lost: {lost}")
        sys.exit(0 if print_checks([("no request lost", lost == 0, f"{lost} lost")]) else 1)


if __name__ == "__main__":
    main()
