"""The free-memory check at a worker's start: does its GPU really have this worker's budget free,
beside what the other registered workers are promised and do not hold yet?
The ledger (worker/memory/ledger.py) only knows the workers that registered there; another tenant, a
second compose project or a pod time-sliced onto the same GPU looks like an empty GPU to it, but
not to the driver (`mem_get_info`). Never touches Redis; torch only through the accounting.
"""

from __future__ import annotations

import logging

from vramguard.shared.settings import Settings
from vramguard.worker.memory.accounting import MemoryAccounting
from vramguard.worker.memory.ledger import DeviceLedger, PlacementError

log = logging.getLogger(__name__)
MIB = 1024 * 1024


def check_free_memory(accounting: MemoryAccounting, settings: Settings, share: float,
                      ledger: DeviceLedger | None = None) -> float:
    """Compare what the GPU has for this worker with its budget, share x total. What it has: free
    memory (mem_get_info: every process counted, a tenant outside the ledger as used and not ours)
    plus what this process already holds there (reserved + outside the allocator), less what every
    other worker registered in `ledger` for this GPU is promised and does not hold yet
    (DeviceLedger.promised_not_held): shares are promises, so a worker that has not grown into its
    share yet still has it.

    Returns the share to plan with: `share` when the budget is there; under Settings.memory_check
    "warn", the share that fits what is left (logged loudly). Raises PlacementError under "refuse"
    (the default), or when not even 1 % of the GPU is left, naming the GPU, what is free, what is
    promised and not held, what the worker needs (MiB and bytes) and the other processes that hold
    memory where the device tells (NVML, the simulated GPU's ledger).
    """
    free, total = accounting.mem_get_info()
    held = accounting.reserved_bytes() + accounting.context_bytes()
    available = free + held
    promised, promised_to = ledger.promised_not_held(total) if ledger is not None else (0, 0)
    needed = int(share * total)
    if available - promised >= needed:
        return share
    gpu = accounting.device_uuid() or settings.cuda_visible_devices or "0"
    others = accounting.other_processes()
    holders = ", ".join(f"pid {pid}: {used / MIB:.0f} MiB" for pid, used in sorted(others, key=lambda p: -p[1]))
    message = (f"GPU {gpu} (CUDA_VISIBLE_DEVICES={settings.cuda_visible_devices or 'unset'}) has "
               f"{available / MIB:.0f} MiB free for this worker of {total / MIB:.0f} MiB (free {available} bytes), "
               f"of which {promised / MIB:.0f} MiB are promised to {promised_to} other registered worker(s) "
               f"and not held by them yet (promised {promised} bytes); its memory share {share:g} needs "
               f"{needed / MIB:.0f} MiB (needed {needed} bytes). Other processes there: "
               f"{holders or 'not known (no NVML)'}")
    fitting = max(0, available - promised) / total
    if settings.memory_check == "refuse" or fitting < 0.01:
        raise PlacementError(message + "; free the GPU, lower VRAMGUARD_MEMORY_SHARE, or set "
                                       "VRAMGUARD_MEMORY_CHECK=warn to plan on what is free")
    log.warning("the GPU does not have this worker's budget free; planning on what is free (memory_check=warn)",
                extra={"error": message, "memory_share": share, "planned_share": round(fitting, 6)})
    return fitting
