"""The forward timeout: configured, or derived from the warmup forward (worker/hang.py)."""

from __future__ import annotations

import pytest

from vramguard.worker.hang import FORWARD_TIMEOUT_MIN_S, derive_forward_timeout_s


def test_a_configured_timeout_wins() -> None:
    assert derive_forward_timeout_s(2.5, measured_s=30.0, measured_items=2, max_batch_size=64) == 2.5


def test_a_fast_model_gets_the_floor() -> None:
    floor_s = derive_forward_timeout_s(None, measured_s=0.002, measured_items=2, max_batch_size=64)
    assert floor_s == FORWARD_TIMEOUT_MIN_S


@pytest.mark.parametrize(("measured_s", "items", "max_batch", "expected_s"),
                         [(3.0, 2, 128, 10 * 3.0 * 64), (0.5, 4, 10, 10 * 0.5 * 3)])
def test_a_slow_model_gets_ten_times_its_full_batch(measured_s, items, max_batch, expected_s) -> None:
    assert derive_forward_timeout_s(None, measured_s, items, max_batch) == pytest.approx(expected_s)
