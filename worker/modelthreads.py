"""Where the model runs: a thread pool of its own, one thread per concurrent forward, that runs
every call into the backend (load and warmup, decode and cost, the forward, the probe). The event
loop never calls the model, and nothing else runs on these threads.

Why not asyncio's default pool (asyncio.to_thread): torch's CPU kernels run on OpenMP (libgomp),
and each thread that starts a parallel region gets a team of OpenMP threads of its own. Once the
teams hold more threads than the machine has cores, libgomp stops spinning between parallel
regions (100 spins instead of 300 000: GCC's libgomp manual, "GOMP_SPINCOUNT"), and every region
of every later forward wakes its team through the kernel instead. The default pool hands
consecutive calls to different threads, so after a few batches the worker had several teams.
Measured on 2 cores, torch 2.13: minilm's batch-1 forward 9.2 ms when its thread is not the first
that ran torch, 6.6 ms when it is; an element-wise op 25 us against 10 us. With one
thread per concurrent forward the teams hold `max_inflight_batches` x torch threads threads.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from vramguard.worker.memory import mirror

P = ParamSpec("P")
T = TypeVar("T")


def _mirrored(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn` inside the device's allocation mirror (worker/memory/mirror.py; a no-op off the
    simulated device), so that what the model allocates on these threads is what the device sees."""
    with mirror.scope():
        return fn(*args, **kwargs)


class ModelThreads:
    """`threads` threads (ModelConfig.max_inflight_batches) for every call into the backend."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="model")

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a model thread; its result, or what it raised."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(_mirrored, fn, *args, **kwargs))

    def close(self) -> None:
        """Take no more calls; threads finish what they run and end (not waited for here)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
