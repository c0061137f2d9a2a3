"""Choosing the next token of each running sequence: greedy (temperature 0) or sampled with
transformers' own logits warpers (TemperatureLogitsWarper, TopPLogitsWarper), the randomness
drawn from a generator seeded by (seed, token position) only. A successor worker that resumes
a sequence from its tokens in Redis therefore draws exactly what the dead worker would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 = greedy; top_p in (0, 1]; seed: the sampler's seed (always set: the worker
    draws one for a request without one and keeps it with the sequence's progress)."""

    temperature: float
    top_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the token at `position` (0-based, in the completion) of a sequence with
    `seed`, from numpy's SeedSequence (a hash designed for deriving independent streams)."""
    state = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF, position]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def choose_tokens(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """The next token of each row.

    Args:
        logits: [batch, vocab] float, the last position's logits of each sequence.
        params: one SamplingParams per row.
        positions: per row, the index in its completion of the token being chosen.
    Returns:
        one token id per row.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy's argmax is vectorised where torch's CPU argmax is not: [32, 49152] float32 logits
        # 0.22 against 2.7 ms (1 thread, the 2-core Xeon), about 2% of a 32-sequence step. Both take
        # the first of equal maxima and a NaN as the maximum.
        chosen = logits.numpy().argmax(axis=-1).tolist()
    else:
        chosen = logits.argmax(dim=-1).tolist()
    for row, (p, position) in enumerate(zip(params, positions, strict=True)):
        if not p.greedy:
            chosen[row] = _sample(logits[row : row + 1].float(), p, position)
    return [int(t) for t in chosen]


def _sample(scores: torch.Tensor, p: SamplingParams, position: int) -> int:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    # The warpers do not read input_ids; an empty [1, 0] stands in for the sequence so far.
    warped = warpers(torch.zeros((1, 0), dtype=torch.long), scores)  # type: ignore[arg-type]
    probs = torch.softmax(warped, dim=-1)
    generator = torch.Generator().manual_seed(position_seed(p.seed, position))
    return int(torch.multinomial(probs, 1, generator=generator).item())
