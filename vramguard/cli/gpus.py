"""The GPUs of this host as nvidia-smi lists them (no torch: the launcher and `vramguard check` stay
light), or simulated ones (VRAMGUARD_SIM_GPUS)."""

from __future__ import annotations

import csv
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from vramguard.cli.placement import Gpu, gpus_from_nvidia_smi, simulated_gpus

SMI_TIMEOUT_S = 30


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory as nvidia-smi reports it, in MiB (its unit with `nounits`)."""

    index: int
    name: str
    total_mib: int
    free_mib: int


def nvidia_smi(query: str, say: Callable[[str], None]) -> str | None:
    """`nvidia-smi --query-gpu=<query> --format=csv,noheader,nounits` output, or None on a host
    without nvidia-smi (or when it fails or hangs: said through `say`)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        say(f"nvidia-smi did not answer in {SMI_TIMEOUT_S} s; going on without GPUs")
        return None
    if out.returncode != 0:
        say(f"nvidia-smi failed (exit {out.returncode}): {out.stderr.strip()[:200]}; going on without GPUs")
        return None
    return out.stdout


def find_gpus(sim_gpus: int, say: Callable[[str], None]) -> list[Gpu]:
    """The GPUs of this host: `sim_gpus` simulated ones when > 0, else what nvidia-smi lists
    (none when nvidia-smi is missing or fails: a CPU-only host)."""
    if sim_gpus > 0:
        return simulated_gpus(sim_gpus)
    out = nvidia_smi("index,uuid", say)
    return [] if out is None else gpus_from_nvidia_smi(out)


def gpu_memory(say: Callable[[str], None]) -> list[GpuMemory]:
    """Every GPU's total and free memory now (empty without nvidia-smi)."""
    out = nvidia_smi("index,name,memory.total,memory.free", say)
    rows = csv.reader((out or "").splitlines(), skipinitialspace=True)
    return [GpuMemory(int(r[0]), r[1].strip(), int(r[2]), int(r[3])) for r in rows if len(r) >= 4]
