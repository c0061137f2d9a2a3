"""Out of memory inside a generation step, handled as the batch path does (worker/batch/execute.py):
the step is undone, its sequences give their KV blocks back and wait to run again in fewer rows and
fewer tokens per step, under caps that were halved (`RowCap`); a sequence that runs out of memory
alone in a step of one token gets its own error. Runs on the model thread; no Redis.

The pool itself never causes this: a full pool preempts (engine.py). What can is a step's
activations beyond the plan (no planner, or a device shared past its promises).

Undoing a step keeps every sequence's tokens as they were before it (the failed step appended
none): the sequence is prefilled again from its prompt and completion so far, as a preempted or
resumed one is, and its next tokens are the same (sampling is derived from the seed and the
token position), so no token is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.worker.generate.engine import Engine
from vramguard.worker.generate.sequence import Sequence

RECOVER_STEPS = 32  # steps without OOM before the row cap goes up by one row


@dataclass(slots=True)
class RowCap:
    """The most rows the running batch may hold now (`value`, from the KV plan's max_running,
    `ceiling`) and the most tokens a step computes (`tokens`, from the plan's token budget,
    `token_ceiling`): both halved after each OOM (down to 1) and raised, by one row and by a
    sixteenth of the budget, after RECOVER_STEPS steps that ran without one (additive increase,
    multiplicative decrease, as worker/memory/budget.py's AdaptiveCap)."""

    ceiling: int
    token_ceiling: int = 1 << 30
    value: int = 0
    tokens: int = 0
    _streak: int = 0

    def __post_init__(self) -> None:
        self.value = self.value or self.ceiling
        self.tokens = self.tokens or self.token_ceiling

    def on_oom(self, rows: int) -> None:
        self.value = max(1, min(self.value, rows) // 2)
        self.tokens = max(1, self.tokens // 2)
        self._streak = 0

    def on_step(self) -> None:
        self._streak += 1
        if self._streak >= RECOVER_STEPS and (self.value < self.ceiling or self.tokens < self.token_ceiling):
            self.value = min(self.ceiling, self.value + 1)
            self.tokens = min(self.token_ceiling, self.tokens + max(1, self.token_ceiling // 16))
            self._streak = 0


def undo_step(engine: Engine) -> list[Sequence]:
    """After an OOM in a step: every running sequence gives its blocks back and goes to the head of
    the waiting queue, unprefilled, in order. Returns them."""
    return engine.preempt_all()
