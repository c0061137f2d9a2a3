"""`python -m worker.profile --model NAME`: the capacity-planning step made one command. Loads
the model on a device, measures baseline, weights and peak memory per batch (and per sequence
length for text), fits peak = fixed + per_item x batch (per token for text) and prints the
derived limits, as a table or, with --json, as one JSON object. Same code as a worker's start
(worker/memory.py); settings come from VRAMGUARD_* like the worker's, flags override them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tqdm import tqdm

from shared.models import BUILTIN
from shared.settings import Settings, SettingsError

MIB = 1024 * 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"a built-in model ({', '.join(sorted(BUILTIN))}) "
                        "or one of VRAMGUARD_MODELS_FILE")
    parser.add_argument("--device", choices=["cuda", "cpu", "sim"], help="default: VRAMGUARD_DEVICE (auto)")
    parser.add_argument("--total-bytes", type=int, help="plan for a device of this size (a GPU you don't have yet); "
                        "on sim, the simulated device's size")
    parser.add_argument("--watermark", type=float, help="fraction of device memory the workers may use (0.8)")
    parser.add_argument("--workers-per-gpu", type=int, help="worker processes sharing the device (1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser.parse_args(argv)


def profile(settings: Settings, total_bytes: int | None, progress: bool = True) -> dict[str, object]:
    """Load, warm up, measure and plan `settings.model` on `settings.device`; the plan's fields
    plus `model` and `device`. Raises MemoryPlanError when the budget cannot hold one item."""
    from worker.__main__ import build_backend
    from worker.execute import run_batch
    from worker.memory import measurement_grid, start_budget

    backend = build_backend(settings)
    config = settings.model_config_for(settings.model)
    sim_bytes = total_bytes if (total_bytes and backend.device == "sim") else settings.sim_memory_bytes

    def warm_up() -> None:
        run_batch(backend, backend.decode(backend.example_inputs(), {}), config.max_batch_size)
        bar.reset(total=len(measurement_grid(backend.max_item_cost, config.max_batch_size)))

    with tqdm(desc=f"measuring {settings.model}", unit="forward", disable=not progress, file=sys.stderr) as bar:
        budget = start_budget(
            backend, sim_memory_bytes=sim_bytes, watermark=settings.watermark, workers_per_gpu=settings.workers_per_gpu,
            max_batch_size_cap=config.max_batch_size, planner=True, success_run=settings.adaptive_success_run,
            warm_up=warm_up, total_bytes=total_bytes, on_step=lambda: bar.update(1),
        )
    return {"model": settings.model, "device": backend.device, **budget.plan.as_dict()}


def render_table(result: dict[str, object]) -> str:
    """The profile as aligned `name  value` lines, bytes also in MiB."""
    lines = []
    for name, value in result.items():
        shown = f"{value}"
        if name.endswith("_bytes") and isinstance(value, int | float):
            shown = f"{value:,.0f} ({value / MIB:,.1f} MiB)" if value >= 1 or value == 0 else f"{value:.3f}"
        lines.append(f"{name:<30} {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides: dict[str, object] = {"model": args.model}
    for field, value in (("device", args.device), ("watermark", args.watermark),
                         ("workers_per_gpu", args.workers_per_gpu)):
        if value is not None:
            overrides[field] = value
    try:
        Settings.from_env()  # names a misspelled VRAMGUARD_* variable
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except (SettingsError, ValueError) as exc:
        print(f"worker.profile: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    from worker.execute import CudaContextLost
    from worker.memory import MemoryPlanError

    try:
        result = profile(settings, args.total_bytes, progress=not args.json)
    except (MemoryPlanError, CudaContextLost, RuntimeError) as exc:  # RuntimeError: --device cuda without a GPU
        print(f"worker.profile: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
