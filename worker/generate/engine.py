"""The compute side of continuous batching, run on the worker's model thread: one call of
`Engine.step` is one forward of the model over a packed batch of tokens (vLLM's scheduler, as
Kwon et al. describe it, and its `max_num_batched_tokens`):

1. every running sequence that decodes feeds its last token (decodes go first: they never wait);
2. the running sequences still prefilling take chunks of their context, in admission order, from
   what is left of the step's token budget;
3. waiting sequences are admitted in order while the budget lasts and the pool has their
   context's blocks plus one free (a prefix already in the pool is shared, not computed again).

A decoding sequence takes one block when its last one is full. When the pool has none left, the
most recently admitted sequence is preempted: its blocks are freed, it keeps its tokens and waits
at the head of the queue to be prefilled again (prompt and completion so far, the path a resumed
sequence takes), so a full cache never fails a request and never runs out of memory. No Redis, no asyncio.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.sampling import choose_tokens
from vramguard.worker.generate.sequence import Sequence, next_text

DEFAULT_ADMIT_BLOCKS = 2.0  # blocks a sequence is expected to need at admission, before any was seen


@dataclass(slots=True)
class Emitted:
    """A sequence's news after a step: text to send (may be empty) and whether it finished."""

    seq: Sequence
    text: str


@dataclass(slots=True)
class Chunk:
    """One sequence's part of a step: `tokens` fed at positions past..past+len-1; `last`: its
    logits give the sequence's next token (a decode, or the prefill's final chunk)."""

    seq: Sequence
    past: int
    tokens: list[int]
    last: bool


@dataclass(slots=True)
class Engine:
    """`backend`: a causal LM with `forward_step(pool, chunks)` and `detokenize` (causal_lm.py,
    synthetic_lm.py); `pool` the KV pool; `token_budget` the most tokens one step computes;
    `max_running` the most sequences holding blocks at once."""

    backend: Any
    pool: KVPool
    token_budget: int
    max_running: int
    running: list[Sequence] = field(default_factory=list)  # holding blocks, in admission order
    waiting: deque[Sequence] = field(default_factory=deque)  # no blocks: new, or preempted (at the head)
    preemptions: int = 0
    forwards: int = 0  # steps that ran the model, counted before it runs (an out-of-memory one too)
    _admit_blocks: float = DEFAULT_ADMIT_BLOCKS  # running mean of the blocks an admission took

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (its context: prompt + resumed tokens) for admission."""
        self.waiting.append(seq)

    def remove(self, gone: set[int]) -> None:
        """Drop the sequences whose id() is in `gone` (finished, cancelled, failed): their blocks are freed."""
        for seq in self.running:
            if id(seq) in gone:
                self.pool.release(seq.request_id)
        self.running = [s for s in self.running if id(s) not in gone]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)

    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def tokens_held(self) -> int:
        """Tokens whose keys and values the running sequences have written to the pool (blocks given
        for a prompt not yet prefilled hold none)."""
        return sum(s.prefilled for s in self.running)

    def room(self, rows: int) -> int:
        """How many more sequences to take from the stream now: none while one waits for blocks,
        else what the free blocks hold at the blocks admissions took so far, within `rows`."""
        if self.waiting:
            return 0
        by_blocks = int(self.pool.free_blocks() // max(1.0, self._admit_blocks))
        return max(0, min(rows - len(self.running), by_blocks))

    def preempt_all(self) -> list[Sequence]:
        """Free every running sequence's blocks and queue them again, in order, ahead of the waiting."""
        seqs = list(self.running)
        for seq in reversed(seqs):
            self._preempt(seq, count=False)
        return seqs

    # --- a step ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Schedule and run one step. Returns the sequences that got a token."""
        chunks = self.schedule()
        if not chunks:
            return []
        self.forwards += 1
        logits = self.backend.forward_step(self.pool, chunks)  # [len(chunks), vocab], last position of each
        advanced = []
        for chunk in chunks:
            seq = chunk.seq
            self.pool.wrote(seq.request_id, seq.context_ids[: chunk.past + len(chunk.tokens)], len(chunk.tokens))
            seq.prefilled = chunk.past + len(chunk.tokens)
        last = [i for i, c in enumerate(chunks) if c.last]
        if last:
            seqs = [chunks[i].seq for i in last]
            rows = logits.index_select(0, torch.tensor(last, device=logits.device))  # not logits[last]: 1000x slower
            tokens = choose_tokens(rows, [s.sampling for s in seqs], [len(s.generated) for s in seqs])
            for seq, token in zip(seqs, tokens, strict=True):
                seq.generated.append(token)
                advanced.append(seq)
        return advanced

    def schedule(self) -> list[Chunk]:
        """This step's chunks: decodes, then prefill chunks, then admissions, within the token budget."""
        chunks: list[Chunk] = []
        for seq in list(self.running):
            if seq.prefilled >= seq.prefill_to and seq in self.running and self._grow(seq, 1):
                chunks.append(Chunk(seq, seq.prefilled, [seq.generated[-1]], True))
        budget = self.token_budget - len(chunks)
        for seq in self.running:
            if budget > 0 and seq.prefilled < seq.prefill_to:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= len(chunks[-1].tokens)
        while budget > 0 and self.waiting and len(self.running) < self.max_running and self._admit(self.waiting[0]):
            seq = self.waiting.popleft()
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= len(chunks[-1].tokens)
        return chunks

    def _prefill_chunk(self, seq: Sequence, budget: int) -> Chunk:
        end = min(seq.prefill_to, seq.prefilled + budget)
        return Chunk(seq, seq.prefilled, seq.context_ids[seq.prefilled : end], end == seq.prefill_to)

    def _admit(self, seq: Sequence) -> bool:
        """Give `seq` its context's blocks (sharing a cached prefix) if the pool has them plus one."""
        context = seq.context_ids
        matched = self.pool.share_prefix(seq.request_id, context)
        fresh = self.pool.blocks_for(len(context)) - self.pool.blocks_for(matched)
        if self.pool.free_blocks() < fresh + 1 or not self.pool.grow(seq.request_id, len(context) - matched):
            self.pool.release(seq.request_id)  # the shared prefix, if any, is given back
            return False
        seq.prefilled, seq.prefill_to = matched, len(context)
        self.running.append(seq)
        self._admit_blocks = 0.9 * self._admit_blocks + 0.1 * (fresh + 1)
        return True

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Room for `tokens` more tokens of `seq`, preempting the newest sequences until there is.
        False when `seq` itself was preempted."""
        while not self.pool.grow(seq.request_id, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self.pool.release(seq.request_id)
        self.running.remove(seq)
        seq.prefilled = seq.prefill_to = 0
        self.waiting.appendleft(seq)
        self.preemptions += count

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
