"""Retry-After for 429 queue_full: the time to serve what is queued at the recent reply rate."""

from __future__ import annotations

import pytest

from vramguard.gateway.admission.backpressure import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    ThroughputMeter,
    retry_after_s,
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_rate_counts_replies_in_the_window_only() -> None:
    clock = Clock()
    meter = ThroughputMeter(window_s=10, clock=clock)
    meter.note_demand()
    assert meter.rate_per_s() is None  # busy for under MIN_SPAN_S: unknown
    clock.now_s += 4
    meter.record(100)
    assert meter.rate_per_s() == pytest.approx(25.0)  # 100 replies over the 4 s watched
    clock.now_s += 4
    meter.record(100)
    assert meter.rate_per_s() == pytest.approx(25.0)  # 200 over 8 s
    clock.now_s += 7
    assert meter.rate_per_s() == pytest.approx(10.0)  # the first 100 fell out of the 10 s window
    clock.now_s += 20
    assert meter.rate_per_s() == pytest.approx(0.1)  # none in the window: under one per window
    clock.now_s += 3600
    meter.note_demand()  # the first request after an idle hour: a new busy spell, nothing known yet
    assert meter.rate_per_s() is None


def test_retry_after_grows_with_the_backlog_and_with_a_stalled_worker() -> None:
    """Workers serve 20 requests a second, then stall: at one depth Retry-After grows as the
    stall lasts; at one moment it grows with the depth (clients refused at different depths are
    not sent back in lock-step)."""
    clock = Clock()
    meter = ThroughputMeter(window_s=10, clock=clock)
    for _ in range(100):
        clock.now_s += 0.05
        meter.note_demand()
        meter.record()
    serving = [retry_after_s(depth, meter.rate_per_s()) for depth in (20, 60, 200)]
    assert serving == [1, 3, 10]
    stalled = []
    for _ in range(4):
        clock.now_s += 3
        meter.note_demand()
        stalled.append(retry_after_s(60, meter.rate_per_s()))
    assert stalled == sorted(stalled) and stalled[0] > serving[1] and stalled[-1] == MAX_RETRY_AFTER_S, stalled


def test_a_silent_window_with_requests_waiting_is_a_stall_not_idleness() -> None:
    """Workers serve 20 requests a second, then stall with 30 of this gateway's requests waiting;
    the next demand comes after 12 s without demand or reply (the waiting clients hold their
    connections). Result: the rate is the stall's, under one reply per window, and Retry-After for
    a depth of 60 the maximum; the same silence with none waiting starts a new busy spell (rate
    unknown, the minimum)."""
    clock = Clock()
    meter = ThroughputMeter(window_s=10, clock=clock)
    for _ in range(100):
        clock.now_s += 0.05
        meter.note_demand(waiting=30)
        meter.record()
    clock.now_s += 12
    meter.note_demand(waiting=30)
    assert meter.rate_per_s() == pytest.approx(0.1)
    assert retry_after_s(60, meter.rate_per_s()) == MAX_RETRY_AFTER_S
    clock.now_s += 12
    meter.note_demand(waiting=0)
    assert meter.rate_per_s() is None
    assert retry_after_s(60, meter.rate_per_s()) == MIN_RETRY_AFTER_S


@pytest.mark.parametrize(
    ("depth", "rate", "expected"),
    [
        (100, 50.0, 2),  # two seconds of work queued
        (100, 30.0, 4),  # rounded up
        (100, 1000.0, MIN_RETRY_AFTER_S),
        (100_000, 1.0, MAX_RETRY_AFTER_S),
        (100, None, MIN_RETRY_AFTER_S),  # no evidence yet
    ],
)
def test_retry_after(depth: int, rate: float | None, expected: int) -> None:
    assert retry_after_s(depth, rate) == expected
