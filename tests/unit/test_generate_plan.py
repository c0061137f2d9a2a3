"""The pure parts of text generation: the KV pool's plan and the step's token budget, the text a sequence may send
(stop strings, held-back characters), the sampler's seed per token position, and the greedy choice."""

from __future__ import annotations

import pytest
import torch

from vramguard.worker.generate.kvplan import KVPlan, KVPlanError, plan_kv, size_token_budget
from vramguard.worker.generate.sampling import SamplingParams, choose_tokens, position_seed
from vramguard.worker.generate.sequence import next_text


def _plan(**overrides: int) -> KVPlan:
    values = {"budget_bytes": 100_000, "context_bytes": 1_000, "weights_bytes": 9_000, "step_fixed_bytes": 10_000,
              "read_bytes_per_token": 2, "bytes_per_token": 10, "measured_bytes_per_token": 10, "block_tokens": 16,
              "token_budget": 64, "max_running": 64, "context_window": 2048, **overrides}
    return plan_kv(**values)  # type: ignore[arg-type]


def test_pool_blocks_pay_for_their_share_of_the_steps_reads() -> None:
    plan = _plan()
    # room = 100000 - 1000 - 9000 - 10000 - 2 trash blocks x 160 = 79680; a block 160 + 16 x 2 = 192 bytes
    assert plan.num_blocks == 79_680 // 192 == 415
    assert plan.tokens_fit == 415 * 16 and plan.pool_bytes == (415 + 2) * 160
    assert plan.step_peak_bytes == 10_000 + 2 * 415 * 16  # a step that reads the whole pool
    assert plan.context_bytes + plan.weights_bytes + plan.step_peak_bytes + plan.pool_bytes <= plan.budget_bytes
    assert plan.fits_alone(415 * 16) and not plan.fits_alone(415 * 16 + 1)


def test_pool_caps_never_plan_more_than_can_be_used() -> None:
    assert _plan(max_running=2, context_window=100).num_blocks == 2 * 7  # two sequences at the full window
    assert _plan(pool_tokens=100).num_blocks == 7


def test_a_budget_without_room_for_a_block_is_refused() -> None:
    with pytest.raises(KVPlanError, match="no block of the KV pool"):
        _plan(budget_bytes=20_000)


def test_the_token_budget_keeps_a_step_near_its_target_time() -> None:
    # 20 + 1 ms a token: 200 ms hold 180 tokens; 4 decode steps of 8 rows (4 x 28 ms) hold fewer
    assert size_token_budget(fixed_ms=20, ms_per_token=1.0, target_ms=200, rows=8, lowest=24, highest=512) == 180
    # 10 ms a token (a CPU): 4 decode steps of 32 rows, 4 x 340 ms, hold 134 tokens
    assert size_token_budget(fixed_ms=20, ms_per_token=10.0, target_ms=200, rows=32, lowest=48, highest=512) == 134
    assert size_token_budget(fixed_ms=20, ms_per_token=50.0, target_ms=200, rows=1, lowest=48, highest=512) == 48
    assert size_token_budget(fixed_ms=1, ms_per_token=0.001, target_ms=200, rows=32, lowest=48, highest=512) == 512


def test_stop_string_cuts_the_text_and_is_never_half_sent() -> None:
    assert next_text("Hello wor", 0, ("world",), finished=False) == ("Hello", False)  # "wor" held back
    assert next_text("Hello world!", 5, ("world",), finished=False) == (" ", True)
    assert next_text("abc", 0, (), finished=False) == ("abc", False)
    assert next_text("ab\ufffd", 0, (), finished=False) == ("ab", False)  # an incomplete character waits
    assert next_text("Hello wor", 0, ("world",), finished=True) == ("Hello wor", False)


def test_sampler_seed_depends_on_seed_and_position_only() -> None:
    assert position_seed(7, 3) == position_seed(7, 3)
    assert len({position_seed(7, i) for i in range(100)} | {position_seed(8, 0)}) == 101


def test_greedy_takes_the_first_of_equal_maxima_and_a_nan_as_torch_does() -> None:
    logits = torch.zeros((3, 50))
    logits[0, [7, 9]] = 2.0  # a tie: the first
    logits[1, 4], logits[1, 30] = float("nan"), 5.0  # a NaN wins, as in torch.argmax
    logits[2, 49] = -1.0  # every other entry equal: the first
    greedy = [SamplingParams(0.0, 1.0, 0)] * 3
    assert choose_tokens(logits, greedy, [0, 0, 0]) == logits.argmax(dim=-1).tolist() == [7, 4, 0]
