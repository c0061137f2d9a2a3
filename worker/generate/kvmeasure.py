"""The KV plan of a starting generative worker, from what it measured: the memory plan's budget,
context, weights and fitted activation peak (worker/memory/budget.py) and the cache bytes one token
really takes, checked against the model config's figure. The arithmetic is kvplan.py's.
"""

from __future__ import annotations

import logging
from typing import Any

from vramguard.worker.generate.kvplan import KVPlan, plan_kv
from vramguard.worker.memory.budget import MemoryBudget
from vramguard.worker.memory.plan import Fit

log = logging.getLogger(__name__)


def measure_kv_bytes_per_token(backend: Any, tokens: int = 16) -> int:
    """Bytes per token a prefill of `tokens` tokens leaves in a fresh cache (the measured figure
    the plan checks the config's against)."""
    from vramguard.worker.generate.kvbatch import KVBatch

    cache = backend.new_cache()
    backend.prefill([1] * tokens, 0, cache)
    batch = backend.new_batch() if hasattr(backend, "new_batch") else KVBatch()
    batch.join(cache, tokens)
    measured = int(batch.cache_bytes() // tokens)
    batch.keep([])  # the cache is freed before serving
    return measured


def build_kv_plan(backend: Any, budget: MemoryBudget, max_running: int) -> KVPlan:
    """The KV plan from the worker's measured memory plan (worker/memory/budget.py): the step's peak is the
    fitted activation peak of a prefill chunk plus one decode token per running row; on a GPU (or the
    simulated one) the plan also leaves room for the caching allocator's holes. Raises
    KVPlanError; logs a warning when the measured bytes per token differ from the config's."""
    plan = budget.plan
    fit = Fit(plan.fixed_bytes, plan.per_unit_bytes)
    measured = measure_kv_bytes_per_token(backend)
    expected = int(backend.kv_bytes_per_token)
    if measured != expected:
        log.warning("KV cache bytes per token measured differ from the model config's",
                    extra={"measured": measured, "config": expected})
    on_cpu = budget.accounting.kind == "cpu"
    context = 0 if on_cpu else plan.context_bytes
    return plan_kv(budget_bytes=plan.budget_bytes, context_bytes=context, weights_bytes=plan.weights_bytes,
                   step_peak_bytes=fit.predict(backend.prefill_chunk_tokens + max_running) if plan.planned else 0,
                   bytes_per_token=max(expected, measured), measured_bytes_per_token=measured,
                   max_running=max_running, prefill_chunk_tokens=backend.prefill_chunk_tokens,
                   context_window=backend.context_window, copy_fraction=2 / backend.kv_layers,
                   cache_tensors=0 if on_cpu else backend.kv_tensors)  # holes are the CUDA caching allocator's
