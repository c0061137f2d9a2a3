"""The worker process's exit codes, which supervisor and `vramguard up` read (vramguard/cli/supervisord.conf,
vramguard/cli/readiness.py). Below runner.py and the main loops it runs (worker/generate/loop.py), which
return them: each imports this module, not the other."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes; supervisor restarts on anything but OK."""

    OK = 0
    INVALID_SETTINGS = 2  # a VRAMGUARD_* value or the models file is invalid (nothing started)
    STARTUP_FAILED = 3  # Redis unreachable at start, model failed to load, memory share refused
    FORCED = 4  # second signal or grace period over: in-flight batches left for reclaim
    CUDA_CONTEXT_LOST = 5  # non-OOM CUDA error or OOM that persists: batch left un-acked, restart for a fresh context
    UNHEALTHY = 6  # the watchdog's probe failed or too many batches failed in a row
    MODEL_INVALID = 7  # the model's class cannot be imported, breaks the contract, or returns what it does not declare
    FORWARD_HUNG = 8  # a forward or a decode ran past its timeout (worker/health/hang.py): batch left un-acked
    TASK_ENDED = 9  # a long-lived task ended, or Redis answered the batch loop unreadably many times (worker/tasks.py)
