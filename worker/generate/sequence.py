"""One generating sequence's state and the text it streams: pure Python, no torch, no Redis.

Text is cut from the decoded completion, never from single tokens (a token may end inside a
multi-byte character; the tokenizer's replacement character U+FFFD is held back until the
next token completes it). While a sequence runs, the last len(longest stop string) - 1
characters are held back too, so a stop string split over two chunks is never half sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramguard.shared.clock import monotonic_ms
from vramguard.shared.protocol import EntryId, RequestId
from vramguard.worker.generate.sampling import SamplingParams

REPLACEMENT = "\ufffd"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request being generated.

    prompt_ids: the prompt's tokens; generated: the completion's tokens so far (resumed ones
    included); max_tokens: the completion's bound. prefilled: tokens of its context in its KV
    blocks; prefill_to: where its current prefill ends (its context at admission; a sequence
    decodes once prefilled reaches it; both 0 while it holds no blocks). chunk: the number of
    the last chunk written (0: none yet); text_sent:
    characters of the completion text in chunks up to `chunk`; text_before: where chunk `chunk`
    starts (a successor re-sends that chunk, since the client may not have it).
    """

    request_id: RequestId
    entry_id: EntryId
    reply_to: str
    deadline_ms: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    generated: list[int] = field(default_factory=list)
    chunk: int = 0
    text_before: int = 0
    text_sent: int = 0
    finish_reason: str | None = None
    prefilled: int = 0
    prefill_to: int = 0
    read_step: int = 0  # the worker's step count when it read the request (steps to its first token)
    resumed: bool = False
    # Monotonic ms, when the worker took it from the stream (or resumed it): its time to first token
    # counts from here.
    started_ms: float = field(default_factory=monotonic_ms)
    first_token_ms: float | None = None  # monotonic, when its first chunk was written
    last_chunk_ms: float = 0.0

    @property
    def largest_tokens(self) -> int:
        """The most tokens it may hold: prompt + max_tokens."""
        return len(self.prompt_ids) + self.max_tokens

    @property
    def context_ids(self) -> list[int]:
        """What the cache must hold before the next token: the prompt and the completion so far."""
        return self.prompt_ids + self.generated

    def finish_if_done(self, eos_token_ids: frozenset[int]) -> None:
        """Set finish_reason "stop" after an end-of-sequence token, "length" at max_tokens."""
        if self.generated and self.generated[-1] in eos_token_ids:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_tokens:
            self.finish_reason = "length"


def next_text(full: str, sent: int, stop: tuple[str, ...], finished: bool) -> tuple[str, bool]:
    """The text to send after the first `sent` characters of the completion `full`.

    Returns (text, stopped): stopped is True when a stop string was found (the text ends just
    before it; the sequence finishes with "stop"). Unfinished sequences hold back what a stop
    string or an incomplete character could still change.
    """
    longest = max((len(s) for s in stop), default=0)
    search_from = max(0, sent - longest + 1) if longest else sent
    hits = [i for i in (full.find(s, search_from) for s in stop) if i != -1]
    if hits:
        return full[sent : max(sent, min(hits))], True
    end = len(full)
    if not finished:
        end -= max(0, longest - 1)
        while end > sent and full[end - 1] == REPLACEMENT:
            end -= 1
    return full[sent : max(sent, end)], False
