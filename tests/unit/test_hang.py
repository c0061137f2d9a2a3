"""Forward and decode timeouts: configured, or scaled from what warmup measured (worker/health/hang.py)."""

from __future__ import annotations

import pytest

from vramguard.worker.health.hang import (
    DECODE_TIMEOUT_MIN_S,
    FORWARD_TIMEOUT_FACTOR,
    FORWARD_TIMEOUT_MIN_S,
    ForwardTimeout,
    measure_seconds_per_cost,
)


def test_a_configured_timeout_wins_for_forwards_and_decodes() -> None:
    timeout = ForwardTimeout(2.5, seconds_per_cost=30.0, decode_s_per_item=30.0)
    assert timeout.for_cost(10_000) == timeout.for_decode(10_000) == 2.5


def test_a_fast_model_gets_the_floors() -> None:
    timeout = ForwardTimeout(None, seconds_per_cost=1e-6, decode_s_per_item=1e-6)
    assert timeout.for_cost(64) == FORWARD_TIMEOUT_MIN_S and timeout.for_decode(64) == DECODE_TIMEOUT_MIN_S


@pytest.mark.parametrize(("per_cost_s", "padded_cost"), [(0.005, 32 * 256), (0.02, 8 * 64)])
def test_each_forward_gets_ten_times_its_measured_cost(per_cost_s: float, padded_cost: int) -> None:
    timeout = ForwardTimeout(None, seconds_per_cost=per_cost_s, decode_s_per_item=0.0)
    assert timeout.for_cost(padded_cost) == pytest.approx(FORWARD_TIMEOUT_FACTOR * per_cost_s * padded_cost)


def test_seconds_per_cost_is_the_slower_run_over_its_padded_cost() -> None:
    runs = iter([0.0, 0.0])
    calls: list[int] = []

    def run(n_items: int) -> None:
        calls.append(n_items)
        next(runs)

    per_cost = measure_seconds_per_cost(max_item_cost=256, n_items=2, run_forward=run)
    assert calls == [2, 2] and 0 <= per_cost < 0.01
