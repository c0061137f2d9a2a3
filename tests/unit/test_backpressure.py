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
    assert meter.rate_per_s() is None  # nothing seen: unknown
    clock.now_s += 30  # an idle gateway is not evidence of stuck workers
    meter.record(100)
    assert meter.rate_per_s() is None  # one burst: not a rate yet
    clock.now_s += 0.5
    assert meter.rate_per_s() is None
    clock.now_s += 3.5
    meter.record(100)
    assert meter.rate_per_s() == pytest.approx(50.0)  # 200 replies over 4 s
    clock.now_s += 8
    assert meter.rate_per_s() == pytest.approx(100 / 8)  # the first 100 fell out of the window
    clock.now_s += 20
    assert meter.rate_per_s() is None


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
