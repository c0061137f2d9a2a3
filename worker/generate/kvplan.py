"""The KV-cache plan's arithmetic (docs/architecture.md "Memory"): what is left of the worker's budget
after its context, weights and the activation peak of one step is the KV cache; a sequence is
admitted to the running batch only when the cache can hold every running sequence at its
largest (prompt + max_tokens), as the running batch lays it out (kvbatch.py: rows x the longest
row). So a sequence that started always finishes: nothing is preempted, and a full cache makes
requests wait in the stream. Pure numbers: no torch, no Redis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass


class KVPlanError(RuntimeError):
    """The budget leaves no room for one sequence of one token after weights and the step's peak."""


@dataclass(frozen=True, slots=True)
class KVPlan:
    """bytes_per_token: one token of one sequence in the cache (model config, checked against a
    measured prefill); kv_budget_bytes = budget - context - weights - step_peak_bytes (the
    predicted peak of one step: a prefill chunk plus a decode token per running row);
    copy_fraction: the share of the cache that exists twice while it changes (a join, a leave and
    every decode step copy a DynamicCache's tensors one layer at a time: torch.cat / index_select
    hold a layer's old and new tensors at once, two layers' worth at most, so 2 / layers);
    tokens_fit = kv_budget_bytes // (bytes_per_token x (1 + copy_fraction)); max_running: the
    configured cap on rows."""

    bytes_per_token: int
    measured_bytes_per_token: int
    budget_bytes: int
    context_bytes: int
    weights_bytes: int
    step_peak_bytes: int
    kv_budget_bytes: int
    tokens_fit: int
    max_running: int
    prefill_chunk_tokens: int
    context_window: int
    copy_fraction: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def admits(self, reserved: Iterable[int], new: int) -> bool:
        """Whether the running sequences (each `reserved` tokens at most) and one more of `new`
        tokens fit, laid out as rows x the longest row, within max_running rows."""
        rows = [*reserved, new]
        return len(rows) <= self.max_running and len(rows) * max(rows) <= self.tokens_fit

    def reserved_bytes(self, reserved: Iterable[int]) -> int:
        """The cache the running sequences may grow to (rows x longest row x bytes per token)."""
        rows = list(reserved)
        return len(rows) * max(rows, default=0) * self.bytes_per_token


def plan_kv(*, budget_bytes: int, context_bytes: int, weights_bytes: int, step_peak_bytes: int,
            bytes_per_token: int, measured_bytes_per_token: int, max_running: int, prefill_chunk_tokens: int,
            context_window: int, copy_fraction: float = 0.0) -> KVPlan:
    """The plan for one worker (all bytes). Raises KVPlanError when no token fits."""
    kv_budget = budget_bytes - context_bytes - weights_bytes - step_peak_bytes
    tokens = int(kv_budget // (bytes_per_token * (1 + copy_fraction))) if bytes_per_token > 0 else 0
    if tokens < 1:
        raise KVPlanError(
            f"the memory budget {budget_bytes / 2**20:.1f} MiB holds context {context_bytes / 2**20:.1f} + weights "
            f"{weights_bytes / 2**20:.1f} + one step {step_peak_bytes / 2**20:.1f} MiB and no KV cache")
    return KVPlan(bytes_per_token=bytes_per_token, measured_bytes_per_token=measured_bytes_per_token,
                  budget_bytes=budget_bytes, context_bytes=context_bytes, weights_bytes=weights_bytes,
                  step_peak_bytes=step_peak_bytes, kv_budget_bytes=kv_budget, tokens_fit=int(tokens),
                  max_running=max_running, prefill_chunk_tokens=prefill_chunk_tokens, context_window=context_window,
                  copy_fraction=copy_fraction)
