"""The KV pool's plan (docs/concepts/kv-cache.md): what is left of the worker's budget after its
context, weights and the activation peak of one step becomes one pool of fixed-size blocks,
allocated once at start (kvpool.py). Pure numbers: no torch, no Redis.

    block_bytes = bytes_per_token x block_tokens
    room        = budget - context - weights - step_fixed_bytes - TRASH_BLOCKS x block_bytes
    num_blocks  = room // (block_bytes + read_bytes_per_token x block_tokens)
    step_peak   = step_fixed_bytes + read_bytes_per_token x num_blocks x block_tokens

step_fixed_bytes is a step's peak at the token budget over no cache; read_bytes_per_token is what
each cached token a step reads adds to that peak (its keys and values read back for attention, its
column of the mask), measured with a cache present (kvmeasure.py); a step reads at most the whole
pool, so each block is planned with its share of that peak. Nothing about the cache is allocated
per step: the pool is one tensor that lives as long as the worker, so the caching allocator leaves
no holes beside it that a plan must set aside (the padded cache it replaced was made again at every
step, join and leave, and needed that allowance).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GENERATION_PARAMS = frozenset({"chunk_ms", "token_budget", "max_step_tokens", "block_tokens", "step_target_ms",
                               "pool_tokens", "prefix_sharing"})
"""params every generative model takes (models file or catalogue `params`): chunk_ms (server.py);
token_budget (tokens one step computes; unset: sized from measured step times), max_step_tokens (the
largest budget, default 256), step_target_ms (the shortest step time the sized budget aims at,
default 200; it aims at STEP_STALL decode steps of max_running rows when that is longer),
block_tokens (tokens per KV block, default 16), pool_tokens (a cap on the pool's tokens below what
the plan allows), prefix_sharing (default true)."""
DEFAULT_MAX_STEP_TOKENS = 256
DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size
DEFAULT_STEP_TARGET_MS = 200.0
STEP_STALL = 4.0
"""A step with prefill chunks may take as long as this many decode steps of a full batch: the running
streams' inter-token time at most this much longer while requests arrive (Sarathi-Serve's stall-free
batching bounds the same thing with a token budget)."""
CPU_POOL_BYTES = 1 << 30
"""The pool's default cap on the CPU, where the budget is a share of the host's memory rather than a
device set aside for the model (vLLM's CPU build has the same kind of default: VLLM_CPU_KVCACHE_SPACE,
4 GiB); pool_tokens overrides it."""
TRASH_BLOCKS = 2  # PagedAttentionCache's two trash sectors (padding slots), a block each


class KVPlanError(RuntimeError):
    """The budget leaves no room for one block after weights and the step's peak."""


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The module docstring's figures (bytes, tokens). bytes_per_token: one token of one sequence in
    the cache (model config, checked against the pool's tensor); pool_bytes: the pool's tensor,
    trash blocks included; tokens_fit = num_blocks x block_tokens; token_budget: the most tokens one
    step computes (decodes and prefill chunks together); max_running: the configured cap on
    sequences holding blocks."""

    bytes_per_token: int
    measured_bytes_per_token: int
    budget_bytes: int
    context_bytes: int
    weights_bytes: int
    step_fixed_bytes: int
    read_bytes_per_token: int
    step_peak_bytes: int
    block_tokens: int
    num_blocks: int
    pool_bytes: int
    tokens_fit: int
    token_budget: int
    max_running: int
    context_window: int

    @property
    def kv_budget_bytes(self) -> int:
        """The KV cache's planned bytes: the pool's tensor (the gateway's kv_cache_plan_bytes)."""
        return self.pool_bytes

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "kv_budget_bytes": self.kv_budget_bytes}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def fits_alone(self, tokens: int) -> bool:
        """Whether one sequence of `tokens` tokens (prompt + max_tokens) fits the pool by itself."""
        return self.blocks_for(tokens) <= self.num_blocks


def plan_kv(*, budget_bytes: int, context_bytes: int, weights_bytes: int, step_fixed_bytes: int,
            read_bytes_per_token: int, bytes_per_token: int, measured_bytes_per_token: int, block_tokens: int,
            token_budget: int, max_running: int, context_window: int, pool_tokens: int | None = None) -> KVPlan:
    """The plan for one worker (the module docstring's formula; all bytes). The pool holds at most
    max_running sequences at the full context window, and at most `pool_tokens` when given. Raises
    KVPlanError when no block fits."""
    block_bytes = bytes_per_token * block_tokens
    room = budget_bytes - context_bytes - weights_bytes - step_fixed_bytes - TRASH_BLOCKS * block_bytes
    per_block = block_bytes + max(0, read_bytes_per_token) * block_tokens
    num_blocks = room // per_block if room > 0 and per_block > 0 else 0
    # More than every running sequence at the full window could never be used.
    num_blocks = min(num_blocks, max_running * -(-context_window // block_tokens))
    if pool_tokens is not None:
        num_blocks = min(num_blocks, -(-pool_tokens // block_tokens))
    if num_blocks < 1:
        raise KVPlanError(
            f"the memory budget {budget_bytes / 2**20:.1f} MiB holds context {context_bytes / 2**20:.1f} + weights "
            f"{weights_bytes / 2**20:.1f} + one step {step_fixed_bytes / 2**20:.1f} MiB and no block of the KV pool "
            f"({per_block / 2**20:.2f} MiB each with its share of the step's reads)")
    return KVPlan(bytes_per_token=bytes_per_token, measured_bytes_per_token=measured_bytes_per_token,
                  budget_bytes=budget_bytes, context_bytes=context_bytes, weights_bytes=weights_bytes,
                  step_fixed_bytes=step_fixed_bytes, read_bytes_per_token=max(0, read_bytes_per_token),
                  step_peak_bytes=step_fixed_bytes + max(0, read_bytes_per_token) * num_blocks * block_tokens,
                  block_tokens=block_tokens, num_blocks=int(num_blocks),
                  pool_bytes=int((num_blocks + TRASH_BLOCKS) * block_bytes), tokens_fit=int(num_blocks * block_tokens),
                  token_budget=token_budget, max_running=max_running, context_window=context_window)


def size_token_budget(*, fixed_ms: float, ms_per_token: float, target_ms: float, rows: int, lowest: int,
                      highest: int) -> int:
    """The tokens one step may compute: as many as keep a step within the longer of `target_ms` and
    STEP_STALL decode steps of `rows` rows, by the measured step time fixed_ms + ms_per_token x
    tokens, between `lowest` (room for every running sequence's decode and a block of prefill) and
    `highest` (max_step_tokens, what the memory plan measured)."""
    if ms_per_token <= 0:
        return highest
    target = max(target_ms, STEP_STALL * (fixed_ms + ms_per_token * rows))
    fitted = int((target - fixed_ms) / ms_per_token)
    return max(lowest, min(highest, fitted))
