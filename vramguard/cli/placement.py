"""Placement: which models run on which GPUs, how many worker processes each, and what share of
each GPU's memory every worker plans from.

Pure Python (no torch, no subprocess, no environment): vramguard/cli/up.py feeds it the GPUs it found
and the GPUS / WORKERS_PER_GPU flags or a TOML placement file, and gets back one `WorkerGroup`
per model x device, which it renders as supervisor programs (vramguard/cli/programs.py). A placement
whose shares on one GPU add up to more than the watermark is refused here, before anything starts.
"""

from __future__ import annotations

import csv
import math
import tomllib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vramguard.shared.models import BUILTIN

# Shares are written to the environment with this many decimals, rounded down, so that the
# written shares of a GPU never add up to more than the watermark the plan was checked against.
SHARE_DECIMALS = 6


class PlacementError(ValueError):
    """The placement cannot run: the message names the GPU, model or value and why."""


@dataclass(frozen=True)
class Gpu:
    """One GPU of this host. `index` is nvidia-smi's (or the simulated device's) number;
    `visible_id` is what the worker's CUDA_VISIBLE_DEVICES gets: the UUID when nvidia-smi gave
    one (CUDA's default device order differs from nvidia-smi's, a UUID cannot), else the index."""

    index: int
    visible_id: str


@dataclass(frozen=True)
class WorkerGroup:
    """`workers` processes of `model` on one device, each planning from `share` of the device's
    total memory (None: no GPU, the worker divides the watermark by `workers_on_device`).
    `workers_on_device` counts the worker processes of every model on that device."""

    model: str
    gpu: Gpu | None
    workers: int
    workers_on_device: int
    share: float | None

    @property
    def device_label(self) -> str:
        return "cpu" if self.gpu is None else f"gpu{self.gpu.index}"

    @property
    def program(self) -> str:
        """The supervisor program name: worker-<model>-gpu<index> (or -cpu)."""
        return f"worker-{self.model}-{self.device_label}"


class ModelPlacement(BaseModel):
    """One `[[model]]` table of a placement file. A model may have several tables for different
    GPUs (3 workers on GPU 0, 2 on GPU 1), never two for one GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    gpus: list[int | str] | Literal["all"] = "all"  # indexes or UUIDs
    workers: int = Field(1, ge=1, le=64)  # worker processes of this model on each of its GPUs
    # Fraction of each of its GPUs' total memory for this model, split equally among its workers
    # there; None: an equal part of what the watermark leaves after the models that set one.
    share: float | None = Field(None, gt=0, le=1)


class PlacementFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: list[ModelPlacement] = Field(min_length=1)


def gpus_from_nvidia_smi(csv_text: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=index,uuid --format=csv,noheader` (one `0, GPU-...` per line)."""
    rows = csv.reader(csv_text.splitlines(), skipinitialspace=True)
    return [Gpu(index=int(row[0]), visible_id=row[1].strip()) for row in rows if len(row) >= 2]


def simulated_gpus(count: int) -> list[Gpu]:
    """`count` simulated GPUs, known by index (the simulated device has no UUIDs)."""
    return [Gpu(index=i, visible_id=str(i)) for i in range(count)]


def select_gpus(spec: str | list[int | str], available: list[Gpu], what: str = "GPUS") -> list[Gpu]:
    """The GPUs a spec names: "all", or indexes and UUIDs ("0,1", "GPU-3f2a...", [0, 1]).

    Raises PlacementError naming the value: an index or UUID not on this host, a GPU named twice
    (by index or by UUID), an empty list, or GPUs asked for on a host that has none.
    """
    if spec == "all":
        return list(available)
    items = [str(s).strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    if not items or "" in items:
        raise PlacementError(f"{what}={_show(spec)}: empty GPU name; use indexes, UUIDs or all")
    if not available:
        raise PlacementError(f"{what}={_show(spec)}: this host has no GPUs (VRAMGUARD_SIM_GPUS=N simulates N)")
    by_name = {g.visible_id: g for g in available} | {str(g.index): g for g in available}
    chosen: list[Gpu] = []
    for item in items:
        gpu = by_name.get(item)
        if gpu is None:
            known = ", ".join(str(g.index) for g in available)
            raise PlacementError(f"{what}={_show(spec)}: no GPU {item!r} on this host (GPUs: {known})")
        if gpu in chosen:
            raise PlacementError(f"{what}={_show(spec)}: GPU {item!r} is named twice")
        chosen.append(gpu)
    return chosen


def load_placement(path: Path, known: Collection[str] | None = None) -> list[ModelPlacement]:
    """Read a placement TOML file whose models are among `known` (Settings.catalogue: the built-in
    ones and the models file's; None: the built-in ones). Raises PlacementError naming the file and the bad entry."""
    known = BUILTIN if known is None else known
    try:
        data = tomllib.loads(path.read_text())
        placement = PlacementFile.model_validate(data)
    except OSError as exc:
        raise PlacementError(f"placement {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise PlacementError(f"placement {path}: not TOML: {exc}") from None
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise PlacementError(f"placement {path}: {detail}") from None
    for m in placement.model:
        if m.name not in known:
            raise PlacementError(f"placement {path}: unknown model {m.name!r}; known: {', '.join(sorted(known))}")
    return placement.model


def plan(models: list[ModelPlacement], available: list[Gpu], watermark: float) -> list[WorkerGroup]:
    """Every model's worker groups with each worker's share of its GPU's total memory.

    On a host without GPUs every model runs on the one device (the CPU) with no share and
    workers_on_device = all worker processes. Raises PlacementError: a GPU whose shares add up to
    more than `watermark` (naming the GPU and the numbers), or a GPU the placement names that
    does not exist.
    """
    if not available:
        for m in models:
            if m.gpus != "all":
                select_gpus(m.gpus, available, what=f"{m.name}.gpus")  # raises: no GPUs here
        _refuse_twice("the CPU", models)
        total = sum(m.workers for m in models)
        return [WorkerGroup(m.name, None, m.workers, total, None) for m in models]
    on_gpu: dict[Gpu, list[ModelPlacement]] = {}
    for m in models:
        for gpu in select_gpus(m.gpus, available, what=f"{m.name}.gpus"):
            on_gpu.setdefault(gpu, []).append(m)
    for gpu, there in on_gpu.items():
        _refuse_twice(f"GPU {gpu.index}", there)
    groups: list[WorkerGroup] = []
    for gpu in sorted(on_gpu, key=lambda g: g.index):
        groups.extend(_plan_gpu(gpu, on_gpu[gpu], watermark))
    return groups


def _plan_gpu(gpu: Gpu, models: list[ModelPlacement], watermark: float) -> list[WorkerGroup]:
    """The groups of one GPU; see plan()."""
    fixed = [m for m in models if m.share is not None]
    taken = sum(m.share for m in fixed if m.share is not None)
    parts = " + ".join(f"{m.name} {m.share:g}" for m in fixed)
    if taken > watermark + 1e-9:
        raise PlacementError(
            f"GPU {gpu.index}: shares add up to {taken:g} ({parts}), more than the watermark {watermark:g}"
        )
    open_workers = sum(m.workers for m in models if m.share is None)
    left = watermark - taken
    if open_workers and left <= 1e-9:
        names = ", ".join(m.name for m in models if m.share is None)
        raise PlacementError(
            f"GPU {gpu.index}: {parts} take the whole watermark {watermark:g}; nothing left for {names}"
        )
    on_device = sum(m.workers for m in models)
    groups = []
    for m in models:
        each = m.share / m.workers if m.share is not None else left / open_workers
        share = math.floor(each * 10**SHARE_DECIMALS) / 10**SHARE_DECIMALS
        groups.append(WorkerGroup(m.name, gpu, m.workers, on_device, share))
    return groups


def _refuse_twice(where: str, models: list[ModelPlacement]) -> None:
    """One model may have several tables (other workers on other GPUs), never two on one device."""
    names = [m.name for m in models]
    for name in names:
        if names.count(name) > 1:
            raise PlacementError(f"{where}: model {name!r} is placed there twice; give it one [[model]] table there")


def _show(spec: str | list[int | str]) -> str:
    return spec if isinstance(spec, str) else ",".join(map(str, spec))
