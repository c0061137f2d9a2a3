"""When a benchmarked sequence ends, the same in every system of the generation suite (and in the
LitServe peer's venv, which has no bench dependencies beyond this)."""

from __future__ import annotations


def done_after(generated: list[int], max_tokens: int, eos_token_ids: frozenset[int]) -> bool:
    """Whether a sequence has ended: `max_tokens` tokens, or an end token last (as the worker stops)."""
    return len(generated) >= max_tokens or bool(generated) and generated[-1] in eos_token_ids
