"""Retry-After for 429 queue_full: the time to serve what is queued at the recent reply rate."""

from __future__ import annotations

import pytest

from gateway.backpressure import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, ThroughputMeter, retry_after_s


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_rate_counts_replies_in_the_window_only() -> None:
    clock = Clock()
    meter = ThroughputMeter(window_s=10, clock=clock)
    assert meter.rate_per_s() is None  # young and nothing seen: unknown
    clock.now_s += 2
    meter.record(100)
    assert meter.rate_per_s() == pytest.approx(50.0)  # 100 replies in the 2 s of its life
    clock.now_s += 9
    meter.record(10)
    assert meter.rate_per_s() == pytest.approx(11.0)  # 110 replies over the 10 s window
    clock.now_s += 1.5
    assert meter.rate_per_s() == pytest.approx(1.0)  # the first 100 fell out of the window
    clock.now_s += 20
    assert meter.rate_per_s() == 0.0  # a whole window without a reply


@pytest.mark.parametrize(
    ("depth", "rate", "expected"),
    [
        (100, 50.0, 2),  # two seconds of work queued
        (100, 30.0, 4),  # rounded up
        (100, 1000.0, MIN_RETRY_AFTER_S),
        (100_000, 1.0, MAX_RETRY_AFTER_S),
        (100, None, MIN_RETRY_AFTER_S),  # no evidence yet
        (100, 0.0, MAX_RETRY_AFTER_S),  # nothing served for a whole window: workers stuck or gone
    ],
)
def test_retry_after(depth: int, rate: float | None, expected: int) -> None:
    assert retry_after_s(depth, rate) == expected
