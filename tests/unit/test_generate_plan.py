"""The pure parts of text generation: the KV plan's admission rule, the text a sequence may send
(stop strings, held-back characters), and the sampler's seed per token position."""

from __future__ import annotations

import pytest

from vramguard.worker.generate.kvplan import KVPlanError, plan_kv
from vramguard.worker.generate.sampling import position_seed
from vramguard.worker.generate.sequence import next_text


def _plan(tokens_fit: int, max_running: int = 64):  # type: ignore[no-untyped-def]
    return plan_kv(budget_bytes=tokens_fit * 10 + 1000, context_bytes=0, weights_bytes=1000, step_peak_bytes=0,
                   bytes_per_token=10, measured_bytes_per_token=10, max_running=max_running,
                   prefill_chunk_tokens=128, context_window=2048)


def test_admission_reserves_rows_times_the_longest_row() -> None:
    plan = _plan(tokens_fit=1000)
    assert plan.tokens_fit == 1000
    assert plan.admits([300, 300], 300)  # 3 x 300 = 900
    assert not plan.admits([300, 300], 400)  # 3 x 400 = 1200: the padded layout, not the sum (1000)
    assert plan.reserved_bytes([100, 250]) == 2 * 250 * 10
    assert not _plan(tokens_fit=10_000, max_running=2).admits([10, 10], 10)


def test_a_budget_without_room_for_a_token_is_refused() -> None:
    with pytest.raises(KVPlanError, match="no KV cache"):
        plan_kv(budget_bytes=1000, context_bytes=0, weights_bytes=900, step_peak_bytes=100, bytes_per_token=10,
                measured_bytes_per_token=10, max_running=1, prefill_chunk_tokens=1, context_window=10)


def test_stop_string_cuts_the_text_and_is_never_half_sent() -> None:
    assert next_text("Hello wor", 0, ("world",), finished=False) == ("Hello", False)  # "wor" held back
    assert next_text("Hello world!", 5, ("world",), finished=False) == (" ", True)
    assert next_text("abc", 0, (), finished=False) == ("abc", False)
    assert next_text("ab\ufffd", 0, (), finished=False) == ("ab", False)  # an incomplete character waits
    assert next_text("Hello wor", 0, ("world",), finished=True) == ("Hello wor", False)


def test_sampler_seed_depends_on_seed_and_position_only() -> None:
    assert position_seed(7, 3) == position_seed(7, 3)
    assert len({position_seed(7, i) for i in range(100)} | {position_seed(8, 0)}) == 101
