"""The memory planner's arithmetic (fit, budget, adaptive cap) and the simulated device."""

from __future__ import annotations

import pytest
import torch

from vramguard.worker.memory.budget import AdaptiveCap
from vramguard.worker.memory.plan import Fit, MemoryPlanError, Sample, fit_peak, measurement_grid, plan_budget, replan
from vramguard.worker.memory.simdevice import MIB, SimDevice


def test_fit_recovers_a_linear_peak() -> None:
    samples = [Sample(b, 1, 16 * MIB + b * 8 * MIB) for b in (1, 2, 4, 8)]
    fit = fit_peak(samples)
    assert fit.fixed_bytes == 16 * MIB
    assert fit.per_unit_bytes == pytest.approx(8 * MIB)


def test_fit_is_an_upper_envelope_of_noisy_samples() -> None:
    samples = [Sample(1, 1, 100), Sample(2, 1, 260), Sample(4, 1, 380), Sample(8, 1, 900)]
    fit = fit_peak(samples)
    assert all(fit.predict(s.cost) >= s.peak_bytes for s in samples)


def test_fit_per_token_uses_padded_cost() -> None:
    # peak = 1 MiB + 2 KiB per token, measured at 2 lengths x 2 batch sizes
    samples = [Sample(b, n, MIB + b * n * 2048) for n in (64, 256) for b in (1, 4)]
    fit = fit_peak(samples)
    assert fit.per_unit_bytes == pytest.approx(2048)
    assert fit.fixed_bytes == pytest.approx(MIB, abs=1)


def test_fit_with_one_cost_charges_everything_per_unit() -> None:
    assert fit_peak([Sample(1, 1, 1000)]) == Fit(0, 1000.0)
    with pytest.raises(ValueError):
        fit_peak([])


def test_fit_clamps_a_negative_slope() -> None:
    fit = fit_peak([Sample(1, 1, 500), Sample(2, 1, 400)])
    assert fit.per_unit_bytes == 0 and fit.fixed_bytes == 500


def plan(**overrides: object):  # type: ignore[no-untyped-def]
    values: dict[str, object] = dict(
        device_kind="sim", total_bytes=512 * MIB, context_bytes=0, weights_bytes=128 * MIB,
        fit=Fit(16 * MIB, 8 * MIB), max_item_cost=1, watermark=0.8, memory_share=0.8, max_batch_size=64,
    )
    values.update(overrides)
    return plan_budget(**values)  # type: ignore[arg-type]


def test_plan_follows_the_design_formula() -> None:
    p = plan()
    # usable = 0.8 x 512 MiB = 409.6 MiB; (409.6 - 128 - 16) / 8 = 33.2 -> 33, well below the cap of 64
    assert p.budget_bytes == int(0.8 * 512 * MIB)
    assert p.planned_batch_size == 33 and p.max_batch_size == 64
    assert p.per_item_bytes == 8 * MIB and p.per_token_bytes == 0 and p.planned_batch_tokens == 0
    assert p.memory_fraction == pytest.approx(0.8) and p.inflight_batches == 1


def test_plan_takes_its_share_of_the_device_and_counts_its_own_context() -> None:
    p = plan(memory_share=0.4, context_bytes=20 * MIB)
    # (204.8 - 20 - 128 - 16) / 8 = 5.1 -> 5; the allocator's cap is the share less the context
    # outside it: (204.8 - 20) / 512
    assert p.planned_batch_size == 5 and p.memory_fraction == pytest.approx((0.4 * 512 - 20) / 512)
    assert p.cap_bytes == int(0.4 * 512 * MIB) - 20 * MIB
    assert p.budget_bytes == int(0.4 * 512 * MIB)


def test_plans_of_workers_sharing_a_gpu_add_up_to_the_watermark() -> None:
    shares = [0.8 / 3] * 3
    plans = [plan(total_bytes=2048 * MIB, memory_share=s) for s in shares]
    assert sum(p.budget_bytes for p in plans) <= 0.8 * 2048 * MIB
    assert len({p.planned_batch_size for p in plans}) == 1  # same share, same plan, whatever the start order


def test_plan_gives_each_concurrent_forward_its_own_room() -> None:
    # room = 409.6 - 128 = 281.6 MiB; two forwards: 140.8 - 16 = 124.8 MiB each -> 15 items
    p = plan(max_inflight_batches=2)
    assert p.inflight_batches == 2 and p.planned_batch_size == 15
    assert 2 * (16 * MIB + 8 * MIB * p.planned_batch_size) + 128 * MIB <= p.budget_bytes


def test_plan_lowers_concurrency_the_budget_cannot_hold() -> None:
    # room = 0.8 x 200 - 128 = 32 MiB: one forward holds 2 items, two forwards hold none
    p = plan(total_bytes=200 * MIB, max_inflight_batches=2)
    assert p.inflight_batches == 1 and p.planned_batch_size == 2


def test_plan_is_capped_by_the_configured_max_batch_size() -> None:
    assert plan(total_bytes=8 * 1024 * MIB).planned_batch_size == 64


def test_plan_for_text_derives_max_batch_tokens() -> None:
    p = plan(fit=Fit(16 * MIB, 64 * 1024), max_item_cost=256, max_batch_size=32)
    # (409.6 - 144) MiB / 64 KiB per token = 4249 tokens; a max-length item costs 16 MiB
    assert p.planned_batch_tokens == 4249
    assert p.per_token_bytes == 64 * 1024 and p.per_item_bytes == 16 * MIB
    assert p.planned_batch_size == 32 and p.max_batch_cost == 4249


def test_plan_recommends_workers_per_gpu() -> None:
    # one full batch of 8 items needs 128 + 16 + 64 = 208 MiB: 0.8 x 2 GiB / K >= 208 MiB for K <= 7
    assert plan(total_bytes=2048 * MIB, max_batch_size=8).recommended_workers_per_gpu == 7


def test_plan_refuses_a_budget_that_cannot_hold_one_item() -> None:
    with pytest.raises(MemoryPlanError, match="cannot hold"):
        plan(total_bytes=160 * MIB)


def test_plan_counts_what_stays_reserved_between_forwards_when_it_exceeds_the_weights() -> None:
    # 160 MiB stay reserved at rest (weights' segments, a workspace, pinned small segments):
    # (409.6 - 160 - 16) / 8 = 29.2 -> 29 items, where the 128 MiB of weights alone left room for 33
    assert plan(resting_bytes=160 * MIB).planned_batch_size == 29
    assert plan(resting_bytes=100 * MIB).planned_batch_size == 33  # less than the weights: they count
    measured = replan(plan(), 0, 160 * MIB)
    assert measured.planned_batch_size == 29 and measured.resting_bytes == 160 * MIB


def test_measurement_grid() -> None:
    assert measurement_grid(1, 64) == [(b, 1) for b in range(1, 9)]
    assert measurement_grid(1, 3) == [(1, 1), (2, 1)]
    assert measurement_grid(256, 2) == [(1, 64), (2, 64), (1, 256), (2, 256)]


def test_adaptive_cap_halves_on_oom_and_grows_back_by_one() -> None:
    cap = AdaptiveCap(ceiling=32, success_run=3)
    cap.on_oom(batch_size=20)
    assert cap.value == 10
    cap.on_oom(batch_size=16)  # a forward larger than the cap: halve the cap itself
    assert cap.value == 5
    for _ in range(3):
        cap.on_success()
    assert cap.value == 6
    for _ in range(2):
        cap.on_success()
    assert cap.value == 6
    for _ in range(1000):
        cap.on_success()
    assert cap.value == 32
    for _ in range(10):
        cap.on_oom(batch_size=1)
    assert cap.value == 1


def test_sim_device_accounts_like_the_cuda_allocator() -> None:
    dev = SimDevice(100 * MIB)
    dev.allocate(40 * MIB)
    with dev.transient(30 * MIB):
        assert dev.memory_allocated() == 70 * MIB
    assert dev.memory_allocated() == 40 * MIB
    assert dev.memory_reserved() == 70 * MIB  # cached until empty_cache
    assert dev.max_memory_allocated() == 70 * MIB
    dev.empty_cache()
    dev.reset_peak_memory_stats()
    assert dev.memory_reserved() == 40 * MIB and dev.max_memory_allocated() == 40 * MIB
    assert dev.mem_get_info() == (60 * MIB, 100 * MIB)


def test_sim_device_raises_the_real_cuda_oom_past_its_limit() -> None:
    dev = SimDevice(100 * MIB)
    dev.set_per_process_memory_fraction(0.5)
    dev.allocate(40 * MIB)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 20.00 MiB"):
        dev.allocate(20 * MIB)
    assert dev.memory_allocated() == 40 * MIB  # a failed allocation takes nothing
    with pytest.raises(ValueError):
        dev.set_per_process_memory_fraction(1.5)


@pytest.mark.parametrize("value", [0, -0.1, 1.01])
def test_watermark_must_be_a_fraction(value: float) -> None:
    from vramguard.shared.settings import Settings

    with pytest.raises(ValueError, match="watermark"):
        Settings(watermark=value)


def test_workers_per_gpu_and_sim_size_are_validated() -> None:
    from vramguard.shared.settings import Settings

    with pytest.raises(ValueError, match="workers_per_gpu"):
        Settings(workers_per_gpu=0)
    with pytest.raises(ValueError, match="sim_memory_bytes"):
        Settings(sim_memory_bytes=10)
