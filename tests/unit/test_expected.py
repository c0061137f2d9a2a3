"""Whether a model's workers can be expected back (gateway/admission/expected.py)."""

from __future__ import annotations

from vramguard.gateway.admission.expected import ReturnWatch


def test_never_seen_is_not_expected() -> None:
    assert not ReturnWatch(30).expected("m", now_ms=1_000_000)


def test_seen_within_the_grace_is_expected_and_not_after() -> None:
    watch = ReturnWatch(30)
    watch.saw("m", 1_000_000)
    assert watch.expected("m", now_ms=1_000_000 + 30_000)
    assert not watch.expected("m", now_ms=1_000_000 + 30_001)
    assert not watch.expected("other", now_ms=1_000_000)


def test_older_evidence_never_moves_the_mark_back() -> None:
    watch = ReturnWatch(1)
    watch.saw("m", 5_000)
    watch.saw("m", 1_000)
    watch.saw("m", None)
    assert watch.last_seen_ms("m") == 5_000


def test_a_zero_grace_disables_waiting() -> None:
    watch = ReturnWatch(0)
    watch.saw("m", 1_000)
    assert not watch.expected("m", now_ms=1_001)
