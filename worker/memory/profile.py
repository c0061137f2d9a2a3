"""`vramguard profile --model NAME` (also `python -m vramguard.worker.memory.profile`): the capacity-planning
step made one command. Loads the model on a device, measures its own context, weights and peak memory per
batch (and per sequence length for text), fits peak = fixed + per_item x batch (per token for text) and prints
the derived limits, then what each worker of a placement on one GPU gets (its share, budget, batch limits):
`--workers-per-gpu K` splits the watermark evenly, `--share S` (repeatable) gives workers explicit shares. As
a table or, with --json, as one JSON object. Same code as a worker's start (worker/memory/budget.py,
worker/memory/plan.py); settings come from VRAMGUARD_* like the worker's, flags override them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import tomli_w
from tqdm import tqdm

from vramguard.shared.folders import FolderError, looks_like_path, served_name
from vramguard.shared.models import BUILTIN, folder_spec
from vramguard.shared.settings import Settings, SettingsError
from vramguard.worker.memory.plan import Fit, MemoryPlanError, Plan, plan_budget

MIB = 1024 * 1024


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {value}")
    return value


def parse_args(argv: list[str] | None, prog: str = "python -m vramguard.worker.memory.profile") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"a built-in model ({', '.join(sorted(BUILTIN))}), "
                        "one of VRAMGUARD_MODELS_FILE, or the path of a model folder (as `vramguard up --model PATH`)")
    parser.add_argument("--device", choices=["cuda", "cpu", "sim"], help="default: VRAMGUARD_DEVICE (auto)")
    parser.add_argument("--total-bytes", type=_positive_int,
                        help="plan for a device of this size, from the forwards measured on --device (a larger GPU "
                        "than this one, say); on sim, the simulated device's size")
    parser.add_argument("--watermark", type=_fraction, help="fraction of device memory the workers may use (0.8)")
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--workers-per-gpu", type=_positive_int,
                           help="worker processes sharing the device, each with watermark / K of it (1)")
    placement.add_argument("--share", type=_fraction, action="append", metavar="S",
                           help="a worker's fraction of the device's memory; repeat for each worker on the GPU "
                           "(their sum must not exceed the watermark)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser.parse_args(argv)


def profile(settings: Settings, total_bytes: int | None, shares: list[float] | None = None,
            progress: bool = True) -> dict[str, object]:
    """Load, warm up, measure and plan `settings.model` on `settings.device`: the plan's fields
    plus `model`, `device` and `workers`, the plan of each worker on one GPU for `shares` (default:
    workers_per_gpu workers of watermark / workers_per_gpu each). Raises MemoryPlanError when the
    budget cannot hold one item, ValueError when the shares exceed the watermark."""
    from vramguard.worker.__main__ import build_backend
    from vramguard.worker.batch.execute import run_batch
    from vramguard.worker.memory.budget import start_budget
    from vramguard.worker.memory.plan import measurement_grid

    shares = shares or [settings.effective_memory_share] * settings.workers_per_gpu
    if sum(shares) > settings.watermark + 1e-9:
        raise ValueError(f"shares {shares} add up to {sum(shares):.4g}, more than the watermark {settings.watermark}")
    backend = build_backend(settings)
    config = settings.model_config_for(settings.model)
    if total_bytes and settings.device == "sim":
        settings = settings.model_copy(update={"sim_memory_bytes": total_bytes})

    def warm_up() -> None:
        run_batch(backend, backend.decode(backend.example_inputs(), {}), config.max_batch_size)
        bar.reset(total=len(measurement_grid(backend.max_item_cost, config.max_batch_size)))

    with tqdm(desc=f"measuring {settings.model}", unit="forward", disable=not progress, file=sys.stderr) as bar:
        budget = start_budget(backend, settings.model_copy(update={"memory_share": shares[0]}), config, warm_up=warm_up,
                              total_bytes=total_bytes, on_step=lambda: bar.update(1), register=False)
    return {"model": settings.model, "device": backend.device, **budget.plan.as_dict(),
            "workers": [_worker_plan(budget.plan, share) for share in shares]}


def _worker_plan(plan: Plan, share: float) -> dict[str, object]:
    """What one worker of `share` gets on this GPU, from the measured fit of `plan`."""
    fit = Fit(plan.fixed_bytes, plan.per_unit_bytes)
    try:
        mine = plan_budget(device_kind=plan.device_kind, total_bytes=plan.total_bytes, context_bytes=plan.context_bytes,
                           weights_bytes=plan.weights_bytes, fit=fit, max_item_cost=plan.max_item_cost,
                           watermark=plan.watermark, memory_share=share, max_batch_size=plan.max_batch_size,
                           max_inflight_batches=plan.inflight_batches, resting_bytes=plan.resting_bytes)
    except MemoryPlanError as exc:
        return {"memory_share": share, "error": str(exc)}
    return {"memory_share": share, "budget_bytes": mine.budget_bytes, "planned_batch_size": mine.planned_batch_size,
            "planned_batch_tokens": mine.planned_batch_tokens, "inflight_batches": mine.inflight_batches}


def render_table(result: dict[str, object]) -> str:
    """The profile as aligned `name  value` lines, bytes also in MiB, then one line per worker."""
    lines = []
    for name, value in result.items():
        if name == "workers":
            continue
        shown = f"{value}"
        if name.endswith("_bytes") and isinstance(value, int | float):
            shown = f"{value:,.0f} ({value / MIB:,.1f} MiB)" if value >= 1 or value == 0 else f"{value:.3f}"
        lines.append(f"{name:<30} {shown}")
    workers = result.get("workers")
    if isinstance(workers, list):
        lines.append(f"\nper GPU: {len(workers)} worker(s)")
        for i, w in enumerate(workers):
            if "error" in w:
                lines.append(f"  worker {i}: share {w['memory_share']:.4g}: {w['error']}")
                continue
            lines.append(f"  worker {i}: share {w['memory_share']:.4g}, budget {w['budget_bytes'] / MIB:,.1f} MiB, "
                         f"batch {w['planned_batch_size']} items"
                         + (f" / {w['planned_batch_tokens']} tokens" if w["planned_batch_tokens"] else "")
                         + f", {w['inflight_batches']} concurrent forward(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m vramguard.worker.memory.profile") -> int:
    """The command (`vramguard profile`, or this module run); returns its exit code (2: a bad option or setting)."""
    args = parse_args(argv, prog)
    with tempfile.TemporaryDirectory(prefix="vramguard-profile-") as scratch:
        overrides: dict[str, object] = {"model": args.model}
        if looks_like_path(args.model):  # a model folder: the one entry of a models file, as `up` writes it
            try:
                spec = folder_spec(served_name(args.model), args.model)
            except FolderError as exc:
                print(f"{prog}: {exc}", file=sys.stderr)
                return 2
            models_file = Path(scratch) / "models.toml"
            models_file.write_text(tomli_w.dumps({spec.name: {"path": str(spec.options["path"])}}))
            overrides.update(model=spec.name, models_file=str(models_file), served_models=[spec.name])
        return _run(args, overrides, prog)


def _run(args: argparse.Namespace, overrides: dict[str, object], prog: str) -> int:
    for field, value in (("device", args.device), ("watermark", args.watermark),
                         ("workers_per_gpu", args.workers_per_gpu)):
        if value is not None:
            overrides[field] = value
    try:
        Settings.from_env()  # names a misspelled VRAMGUARD_* variable
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except (SettingsError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    from vramguard.worker.memory.oom import CudaContextLost

    try:
        result = profile(settings, args.total_bytes, args.share, progress=not args.json)
    except (MemoryPlanError, CudaContextLost, RuntimeError, ValueError) as exc:  # RuntimeError: cuda without a GPU
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
