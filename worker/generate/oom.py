"""Out of memory inside a generation step (prefill or decode), handled as the batch path does
(worker/batch/execute.py): the step is undone, the running batch's KV cache freed, and its sequences
wait to run again in fewer rows, under a row cap that was halved (`RowCap`); a sequence that
runs out of memory alone gets its own error. Runs on the model thread; no Redis.

Undoing a step keeps every sequence's tokens as they were before it (the tokens of the failed
step are dropped, never sent): the sequence is prefilled again from its prompt and completion
so far, as a resumed one is, and its next tokens are the same (sampling is derived from the seed
and the token position), so no token is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.worker.generate.engine import Engine
from vramguard.worker.generate.sequence import Sequence

RECOVER_STEPS = 32  # steps without OOM before the row cap goes up by one row


@dataclass(slots=True)
class RowCap:
    """The most rows the running batch may hold now: the KV plan's max_running, halved after each
    OOM (down to 1) and raised by one row after RECOVER_STEPS steps that ran without one."""

    ceiling: int
    value: int = 0
    _streak: int = 0

    def __post_init__(self) -> None:
        self.value = self.value or self.ceiling

    def on_oom(self, rows: int) -> None:
        self.value = max(1, min(self.value, rows) // 2)
        self._streak = 0

    def on_step(self) -> None:
        self._streak += 1
        if self._streak >= RECOVER_STEPS and self.value < self.ceiling:
            self.value += 1
            self._streak = 0


def step_marks(engine: Engine) -> list[tuple[Sequence, int]]:
    """The sequences a step computes (running rows, then joining ones) with their token counts before it."""
    return [(s, len(s.generated)) for s in (*engine.running, *(s for s, _ in engine.joining))]


def undo_step(engine: Engine, marks: list[tuple[Sequence, int]]) -> list[Sequence]:
    """After an OOM in a step: free the batch's KV cache and the joining sequences' caches, put
    each sequence's tokens back to `marks` and mark it unprefilled. Returns the sequences, in order,
    to be admitted again (the engine is left empty)."""
    engine.kv.keep([])
    for _seq, cache in engine.joining:
        free = getattr(cache, "free", None)  # a simulated cache holds device blocks; a DynamicCache is collected
        if free is not None:
            free()
    engine.running, engine.joining = [], type(engine.joining)()
    for seq, tokens in marks:
        del seq.generated[tokens:]
        seq.prefilled = 0
    return [seq for seq, _ in marks]
