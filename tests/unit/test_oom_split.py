"""run_batch under a memory budget on the simulated device: the soft guard, OOM halving, 413 for
an item that cannot fit alone, a lost context; and the cost-based grouping of a read."""

from __future__ import annotations

import threading
import time

import pytest

from vramguard.shared.models import ModelConfig, ModelOverrides
from vramguard.shared.settings import Settings
from vramguard.worker.batch.costing import group_by_cost
from vramguard.worker.batch.execute import CudaContextLost, chunk_by_cost, run_batch
from vramguard.worker.memory.accounting import SimAccounting
from vramguard.worker.memory.budget import MemoryBudget, start_budget
from vramguard.worker.memory.simdevice import MIB
from vramguard.worker.models.synthetic import SyntheticBackend


@pytest.fixture
def make_budget():  # type: ignore[no-untyped-def]
    def make(total_mib: int, **kwargs: object) -> tuple[SyntheticBackend, MemoryBudget]:
        p = {"weights_mib": 8, "fixed_mib": 4, "item_mib": 4, **kwargs.pop("params", {})}  # type: ignore[dict-item]
        cap = int(kwargs.pop("cap", 64))
        settings = Settings(model="synthetic", fault_injection=True, sim_memory_bytes=total_mib * MIB, watermark=0.8,
                            sim_context_bytes=2 * MIB, sim_module_bytes=2 * MIB,
                            adaptive_success_run=4,
                            memory_planner=bool(kwargs.pop("planner", True)),
                            models={"synthetic": ModelOverrides(max_batch_size=cap, **kwargs)})  # type: ignore[arg-type]
        backend = SyntheticBackend(ModelConfig(params=p), "sim", settings)
        return backend, start_budget(backend, settings, settings.model_config_for("synthetic"))

    return make


def test_planned_budget_runs_a_large_batch_without_oom(make_budget) -> None:
    backend, budget = make_budget(64)
    # 0.8 x 64 = 51.2 MiB, less 4 MiB outside the allocator (context, kernel modules); the 8 MiB of
    # weights hold a whole 20 MiB segment (requests under 10 MiB get one): (51.2 - 4 - 20 - 4) / 4
    # = 5.8 -> 5 items per forward
    assert budget.plan.weights_bytes == 20 * MIB and budget.plan.context_bytes == 4 * MIB
    assert budget.plan.planned_batch_size == 5
    results, stats = run_batch(backend, list(range(40)), 64, budget=budget)
    assert [r.output for r in results] == list(range(40))
    assert stats.oom_events == 0 and budget.oom_events == 0
    assert stats.largest_forward <= 5 and budget.largest_forward <= 5
    assert budget.accounting.peak_bytes() <= budget.limit_bytes
    assert budget.accounting.max_reserved_bytes() <= budget.plan.cap_bytes


def test_soft_guard_splits_when_memory_is_taken(make_budget) -> None:
    backend, budget = make_budget(64)
    assert isinstance(budget.accounting, SimAccounting)
    budget.accounting.device.allocate(12 * MIB)  # something else holds memory: only 2 items fit now
    results, stats = run_batch(backend, list(range(9)), 64, budget=budget)
    assert [r.output for r in results] == list(range(9))
    assert stats.oom_events == 0 and stats.splits >= 1 and budget.batch_splits >= 1


def test_the_soft_guard_empties_the_cache_when_cached_segments_leave_no_room_for_the_forward(make_budget) -> None:
    backend, budget = make_budget(64)
    assert isinstance(budget.accounting, SimAccounting)
    device = budget.accounting.device
    # a 22 MiB segment cached by an earlier forward: 20 (weights) + 22 + a forward of 5 (24 MiB) is
    # over the cap of 47.2 MiB
    device.release(device.allocate(22 * MIB))
    assert device.memory_reserved() == 42 * MIB
    results, stats = run_batch(backend, list(range(5)), 64, budget=budget)
    assert [r.output for r in results] == list(range(5))
    assert budget.cache_releases == 1 and stats.oom_events == 0 and stats.splits == 0
    assert budget.accounting.max_reserved_bytes() <= budget.plan.cap_bytes


def test_the_soft_guard_keeps_the_cache_when_the_forward_fits_beside_it(make_budget) -> None:
    backend, budget = make_budget(64)
    assert isinstance(budget.accounting, SimAccounting)
    device = budget.accounting.device
    device.release(device.allocate(14 * MIB))  # a cached 14 MiB segment: 20 + 14 + 8 (one item) fits 47.2 MiB
    run_batch(backend, [0], 64, budget=budget)
    assert budget.cache_releases == 0 and device.memory_reserved() == 34 * MIB


def test_oom_splits_in_halves_and_lowers_the_cap(make_budget) -> None:
    backend, budget = make_budget(64, planner=False, cap=32)
    assert budget.max_batch_size == 32
    results, stats = run_batch(backend, list(range(32)), 32, budget=budget)
    assert [r.output for r in results] == list(range(32))
    assert stats.oom_events >= 1 and budget.oom_events == stats.oom_events
    assert budget.max_batch_size < 32  # adaptive cap went down


def test_an_item_that_cannot_fit_alone_gets_413_and_the_rest_succeed(make_budget) -> None:
    backend, budget = make_budget(64, planner=False, cap=8)
    items: list[object] = [0, 1, 2, {"alloc_mib": 1000}, 4, 5, 6, 7]
    results, stats = run_batch(backend, items, 8, budget=budget)
    assert [r.error_code for r in results] == [None] * 3 + ["input_too_large"] + [None] * 4
    assert [r.output for r in results if r.ok] == [0, 1, 2, 4, 5, 6, 7]


def test_oom_that_persists_means_the_context_is_lost(make_budget) -> None:
    backend, budget = make_budget(64)
    run_batch(backend, [{"fault": "leak"}], 8, budget=budget)  # keeps all free memory for good
    with pytest.raises(CudaContextLost, match="persists"):
        run_batch(backend, [1, 2], 8, budget=budget)


def test_a_non_oom_cuda_error_means_the_context_is_lost(make_budget) -> None:
    backend, budget = make_budget(64)
    with pytest.raises(CudaContextLost, match="illegal memory access"):
        run_batch(backend, [1, {"fault": "cuda_error"}, 3], 8, budget=budget)


def test_fault_file_is_one_shot(make_budget, tmp_path) -> None:
    backend, budget = make_budget(64)
    flag = tmp_path / "cuda-error"
    flag.touch()
    backend.fault_file = flag
    with pytest.raises(CudaContextLost):
        run_batch(backend, [1], 8, budget=budget)
    assert not flag.exists()
    assert run_batch(backend, [1], 8, budget=budget)[0][0].output == 1


def test_chunks_respect_items_and_padded_cost() -> None:
    assert chunk_by_cost([1] * 5, 2, None) == [range(0, 2), range(2, 4), range(4, 5)]
    assert chunk_by_cost([10, 10, 50, 10], 8, 60) == [range(0, 2), range(2, 3), range(3, 4)]
    assert chunk_by_cost([100], 8, 60) == [range(0, 1)]  # too costly alone: its own chunk
    assert chunk_by_cost([], 8, 60) == []


PAD = ModelConfig().pad_factor  # the default


def test_group_by_cost_keeps_a_long_input_away_from_short_ones() -> None:
    entries = [[3]] * 3 + [[64]] + [[4]] * 4  # 7 short texts and 1 at the model's maximum
    groups = group_by_cost(entries, 64, 10_000, pad_factor=PAD)
    assert groups == [[0, 1, 2, 4, 5, 6, 7], [3]]


def test_group_by_cost_keeps_natural_lengths_in_one_forward() -> None:
    """Lengths spread as sentences are (3 to 46 tokens, padding 2.2x) run as one forward at the
    default; a pad factor of 2 splits them in two."""
    entries = [[c] for c in (12, 19, 25, 3, 46, 21, 17, 30, 14, 22, 9, 28)]
    assert group_by_cost(entries, 32, None, pad_factor=PAD) == [sorted(range(12), key=lambda i: entries[i][0])]
    assert len(group_by_cost(entries, 32, None, pad_factor=2.0)) == 2


def test_group_by_cost_limits() -> None:
    assert group_by_cost([[1]] * 10, 4, None, pad_factor=PAD) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # padded cost 30 per group
    assert group_by_cost([[10, 10], [10], [10]], 64, 30, pad_factor=PAD) == [[0, 1], [2]]
    assert group_by_cost([], 4, None, pad_factor=PAD) == []


class CublasAllocBackend(SyntheticBackend):
    """Fails a forward of more than two items the way cuBLAS does when it cannot allocate its
    workspace (the real text of torch's RuntimeError)."""

    def forward(self, batch: object) -> object:
        assert isinstance(batch, list)
        if len(batch) > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return super().forward(batch)


def test_a_cublas_allocation_failure_is_split_and_retried_not_a_restart(make_budget) -> None:
    _, budget = make_budget(64, planner=False, cap=8)
    backend = CublasAllocBackend(ModelConfig(params={"weights_mib": 0, "fixed_mib": 0, "item_mib": 0}), "cpu",
                                 Settings(model="synthetic"))
    results, stats = run_batch(backend, list(range(8)), 8, budget=budget)
    assert [r.output for r in results] == list(range(8))
    assert stats.oom_events >= 1 and stats.splits >= 2 and budget.max_batch_size < 8


def test_other_cublas_errors_still_mean_the_context_is_lost(make_budget) -> None:
    class Broken(SyntheticBackend):
        def forward(self, batch: object) -> object:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`")

    _, budget = make_budget(64, planner=False, cap=8)
    backend = Broken(ModelConfig(), "cpu", Settings(model="synthetic"))
    with pytest.raises(CudaContextLost, match="EXECUTION_FAILED"):
        run_batch(backend, [1, 2], 8, budget=budget)


def test_with_three_forwards_in_flight_an_oom_caused_by_a_neighbour_forward_is_retried_not_a_restart(
    make_budget,
) -> None:
    """1. max_inflight_batches=3; one forward holds far more than its cost says (an input the cost
       model mispredicts: 110 MiB more) for 0.5 s.
    2. While it runs, two other threads run batches of 4 items: each OOMs down to single items.
    Result: the single items wait for the device to be theirs and succeed; nothing raises
    CudaContextLost (no exit 5), although OOM events were counted."""
    backend, budget = make_budget(256, max_inflight_batches=3,
                                  params={"weights_mib": 64, "fixed_mib": 8, "item_mib": 4, "batch_ms": 500})
    assert budget.plan.inflight_batches == 3
    device = budget.accounting.device
    outcomes: dict[str, object] = {}

    def run(name: str, items: list[object]) -> None:
        try:
            outcomes[name] = run_batch(backend, items, 8, budget=budget)[0]
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcomes[name] = exc

    hog = threading.Thread(target=run, args=("hog", [{"alloc_mib": 110}]))
    hog.start()
    deadline = time.monotonic() + 30
    while device.memory_allocated() < 150 * MIB:  # the hog holds its memory
        assert time.monotonic() < deadline and hog.is_alive(), outcomes
        time.sleep(0.01)
    others = [threading.Thread(target=run, args=(f"batch-{i}", [i * 10 + k for k in range(4)])) for i in range(2)]
    for t in [*others]:
        t.start()
    for t in [hog, *others]:
        t.join(60)
    assert not any(isinstance(o, Exception) for o in outcomes.values()), outcomes
    for i in range(2):
        assert [r.output for r in outcomes[f"batch-{i}"]] == [i * 10 + k for k in range(4)]  # type: ignore[attr-defined]
    assert budget.oom_events >= 1
