"""When memory binds, the paged pool holds token states, not reservations: the mixed workload's kind of
requests (bench/kv_utilisation.py: prompts of 16-1,500 tokens, answers of 14-90, max_tokens the room
left in the window) through the worker's engine on the simulated GPU, against handing requests to the
same engine only while their worst case (prompt + max_tokens) fits, as the engine before the pool
reserved it."""

from __future__ import annotations

import pytest

from bench.kv_utilisation import run


@pytest.mark.slow
def test_a_bound_pool_holds_tokens_and_runs_three_times_the_reserved_sequences() -> None:
    paged, reserved = run("paged", requests=64), run("reserved", requests=64)
    assert paged.bound_steps > 0 and reserved.bound_steps > 0, (paged, reserved)  # memory did bind in both
    assert paged.tokens_fit == reserved.tokens_fit
    assert paged.kv_utilisation >= 0.9, paged
    assert paged.running_median >= 3 * reserved.running_median, (paged, reserved)
    assert reserved.kv_utilisation < 0.5, reserved  # the worst case held from admission, mostly empty


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy is one of"):
        run("first-fit")
