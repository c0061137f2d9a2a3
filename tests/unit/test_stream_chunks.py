"""gateway/protocols/chunks.py: a generated stream forwards each character once, in order, whatever
chunks arrive (re-sends, overlaps, two workers' different cuts, gaps)."""

from __future__ import annotations

import pytest

from vramguard.gateway.protocols.chunks import Chunk, StreamGapError, TextJoin

TEXT = " w3 w4 w5 w6 w7 w8 w9 w10 w11"


def chunk(number: int, start: int, end: int, finish: str | None = None) -> Chunk:
    return {"chunk": number, "offset": start, "text": TEXT[start:end], "finish_reason": finish,
            "prompt_tokens": 2, "completion_tokens": 9}


def joined(chunks: list[Chunk]) -> tuple[str, list[Chunk]]:
    join = TextJoin("r1", bound=8)
    out = [c for c in chunks for c in join.add(c)]
    return "".join(str(c["text"]) for c in out), out


def test_chunks_in_order_pass_unchanged() -> None:
    text, out = joined([chunk(1, 0, 6), chunk(2, 6, 12), chunk(3, 12, len(TEXT), "length")])
    assert text == TEXT and out[-1]["finish_reason"] == "length" and len(out) == 3


def test_a_resent_chunk_and_an_overlapping_one_add_only_their_new_text() -> None:
    """A successor re-sends the last chunk the progress names; a worker whose publish looked failed
    (its reply lost) re-sends from where that chunk started, with more text."""
    text, out = joined([chunk(1, 0, 6), chunk(2, 6, 12), chunk(2, 6, 12), chunk(2, 6, 18),
                        chunk(3, 18, len(TEXT), "length")])
    assert text == TEXT
    assert [(c["offset"], c["text"]) for c in out][2] == (12, TEXT[12:18])


def test_two_workers_cutting_differently_under_the_same_numbers_give_the_text_once() -> None:
    """A stalled worker (chunks a) and its successor (chunks b) number their chunks alike but cut
    them at different places; a dedupe by number would forward a2 then b3, repeating text."""
    a = [chunk(1, 0, 3), chunk(2, 3, 9), chunk(3, 9, 15)]
    b = [chunk(2, 3, 6), chunk(3, 6, 12), chunk(4, 12, 21), chunk(5, 21, len(TEXT), "stop")]
    text, _ = joined([a[0], a[1], b[0], b[1], a[2], b[2], b[3]])
    assert text == TEXT


def test_a_gap_waits_for_the_missing_text_and_never_skips_it() -> None:
    join = TextJoin("r1", bound=8)
    assert [c["text"] for c in join.add(chunk(1, 0, 6))] == [TEXT[:6]]
    assert join.add(chunk(3, 12, 18)) == [] and join.sent == 6  # 6..12 lost on the way: held
    assert join.add(chunk(4, 18, 24)) == [] and join.sent == 6
    out = join.add(chunk(2, 3, 12))  # the re-send that covers the gap
    assert [c["text"] for c in out] == [TEXT[6:12], TEXT[12:18], TEXT[18:24]]
    assert join.sent == 24 and not join.finished


def test_the_finish_is_forwarded_once_and_nothing_after_it() -> None:
    join = TextJoin("r1", bound=8)
    join.add(chunk(1, 0, 6))
    out = join.add({**chunk(2, 6, 6), "finish_reason": "stop"})  # a finish with no new text
    assert [(c["text"], c["finish_reason"]) for c in out] == [("", "stop")] and join.finished
    assert join.add(chunk(3, 6, 12)) == []


def test_a_gap_that_is_never_filled_ends_the_stream_past_the_bound() -> None:
    join = TextJoin("r1", bound=2)
    join.add(chunk(1, 0, 3))
    join.add(chunk(3, 6, 9))
    join.add(chunk(4, 9, 12))
    with pytest.raises(StreamGapError):
        join.add(chunk(5, 12, 15))
