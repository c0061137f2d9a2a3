"""The compute side of continuous batching, run on the worker's model thread: one call of
`Engine.step` is one decode step of every running sequence, plus the prefill of the sequences
joining next, prefill_chunk_tokens prompt tokens at most in all (the cap on how long joining
prompts stall the others; a longer prompt is prefilled in chunks over several steps).
Sequences join at the end of a step and leave before the next one. No Redis, no asyncio.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vramguard.worker.generate.kvbatch import KVBatch
from vramguard.worker.generate.sampling import choose_tokens
from vramguard.worker.generate.sequence import Sequence, next_text


@dataclass(slots=True)
class Emitted:
    """A sequence's news after a step: text to send (may be empty) and whether it finished."""

    seq: Sequence
    text: str


@dataclass(slots=True)
class Engine:
    """`backend`: a causal LM with prefill / step_forward / detokenize / new_cache (causal_lm.py)."""

    backend: Any
    kv: Any = None  # KVBatch, or the backend's own (new_batch(): a simulated one); set in __post_init__
    running: list[Sequence] = field(default_factory=list)  # the rows of `kv`, in order
    joining: deque[tuple[Sequence, Any]] = field(default_factory=deque)  # prefilling, with their caches

    def __post_init__(self) -> None:
        if self.kv is None:
            self.kv = self.backend.new_batch() if hasattr(self.backend, "new_batch") else KVBatch()

    def add(self, seq: Sequence) -> None:
        """Queue an admitted sequence for prefill (its context: prompt + resumed tokens)."""
        self.joining.append((seq, self.backend.new_cache()))

    def remove(self, gone: set[int]) -> None:
        """Drop the sequences whose id() is in `gone` (finished, cancelled, failed): their cache is freed."""
        keep = [i for i, s in enumerate(self.running) if id(s) not in gone]
        if len(keep) != len(self.running):
            self.kv.keep(keep)
            self.running = [self.running[i] for i in keep]
        self.joining = deque((s, c) for s, c in self.joining if id(s) not in gone)

    def step(self) -> list[Sequence]:
        """One decode step of the running rows, then prefill of joining sequences in order, up to
        prefill_chunk_tokens tokens (each joins the batch when its prefill is done). Returns the
        sequences that got a token."""
        advanced: list[Sequence] = []
        if self.running:
            logits = self.kv.step(self.backend.step_forward, [s.generated[-1] for s in self.running])
            tokens = choose_tokens(logits, [s.sampling for s in self.running], [len(s.generated) for s in self.running])
            for seq, token in zip(self.running, tokens, strict=True):
                seq.generated.append(token)
                advanced.append(seq)
        budget = self.backend.prefill_chunk_tokens  # prompt tokens this step may prefill, over joining sequences
        while self.joining and budget > 0:
            joined, budget = self._prefill_chunk(budget)
            if joined is not None:
                advanced.append(joined)
        return advanced

    def _prefill_chunk(self, budget: int) -> tuple[Sequence | None, int]:
        """Prefill up to `budget` tokens of the first joining sequence. Its cache holds the
        context but the last resumed token (fed at its first decode step, as for a running row);
        a fresh sequence takes its first token from the prefill's logits. Returns it if it got
        one, and the budget left."""
        seq, cache = self.joining[0]
        target = len(seq.prompt_ids) + max(0, len(seq.generated) - 1)
        chunk = seq.context_ids[seq.prefilled : min(target, seq.prefilled + budget)]
        logits = self.backend.prefill(chunk, seq.prefilled, cache)
        seq.prefilled += len(chunk)
        budget -= len(chunk)
        if seq.prefilled < target:
            return None, budget
        self.joining.popleft()
        self.kv.join(cache, target)
        self.running.append(seq)
        if seq.generated:
            return None, budget  # resumed: its next token comes from the next decode step
        seq.generated.append(choose_tokens(logits[None, :], [seq.sampling], [0])[0])
        return seq, budget

    def texts(self, seqs: list[Sequence], eos_token_ids: frozenset[int], final: bool = False) -> list[Emitted]:
        """For each sequence: mark it finished (end token, max_tokens, or a stop string) and cut
        the completion text it has not sent yet."""
        out = []
        for seq in seqs:
            if not final:
                seq.finish_if_done(eos_token_ids)
            full = self.backend.detokenize(seq.generated)
            text, stopped = next_text(full, seq.text_sent, seq.stop, seq.finish_reason is not None)
            if stopped:
                seq.finish_reason = "stop"
            out.append(Emitted(seq, text))
        return out
