"""A worker's start under a memory budget, and `python -m vramguard.worker.memory.profile` as a real process."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from tests.helpers import ROOT, service_env
from vramguard.worker.models import create_backend
from vramguard.worker.runner import ExitCode, Worker

MIB = 1024 * 1024


@pytest.mark.parametrize("device_mib", [100, 150, 170])
async def test_a_device_too_small_stops_the_worker_at_start(settings_factory, caplog: pytest.LogCaptureFixture,
                                                            device_mib: int) -> None:
    """1. The synthetic model's 128 MiB of weights on a 100 MiB device (they do not load), on
    150 MiB (the warmup OOMs), or on 170 MiB (0.8 x 170 = 136 MiB cannot hold weights + fixed +
    one item).
    Result: the worker exits STARTUP_FAILED (supervisor gives up after startretries), and its log
    says memory is the reason, not Redis (the memory errors are RuntimeErrors too)."""
    settings = settings_factory(model="synthetic", device="sim", sim_memory_bytes=device_mib * MIB)
    worker = Worker(settings, create_backend(settings, "sim"))
    with caplog.at_level(logging.ERROR, logger="vramguard.worker.runner"):
        assert await worker.run() == ExitCode.STARTUP_FAILED
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert messages == ["memory budget too small or device failed at start"], messages


def run_profile(*args: str) -> subprocess.CompletedProcess[str]:
    env = service_env("redis://127.0.0.1:1/0")
    return subprocess.run([sys.executable, "-m", "vramguard.worker.memory.profile", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_profile_json_plans_for_a_device_of_a_given_size() -> None:
    done = run_profile("--model", "synthetic", "--device", "sim", "--total-bytes", str(1024 * MIB),
                       "--workers-per-gpu", "2", "--watermark", "0.5", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["total_bytes"] == 1024 * MIB and plan["watermark"] == 0.5 and plan["memory_share"] == 0.25
    # the simulated context (8 MiB) and kernel modules (4 MiB) live outside the allocator
    assert plan["context_bytes"] == 12 * MIB and plan["weights_bytes"] == 128 * MIB
    assert plan["fixed_bytes"] == 16 * MIB and plan["per_item_bytes"] == 8 * MIB
    # 0.5 x 1024 / 2 = 256 MiB; (256 - 12 - 144) / 8 = 12.5 -> 12 items
    assert plan["max_batch_size"] == 64 and plan["planned_batch_size"] == 12
    assert [w["memory_share"] for w in plan["workers"]] == [0.25, 0.25]  # the two workers on the GPU
    assert [w["planned_batch_size"] for w in plan["workers"]] == [12, 12]


@pytest.mark.slow
def test_profile_prints_what_each_worker_of_a_placement_gets() -> None:
    done = run_profile("--model", "synthetic", "--device", "sim", "--total-bytes", str(1024 * MIB),
                       "--share", "0.5", "--share", "0.25")
    assert done.returncode == 0, done.stderr
    # 0.5 x 1024 = 512 MiB: (512 - 12 - 144) / 8 = 44.5 -> 44 items; 0.25 x 1024 = 256 MiB: 12 items
    assert "worker 0: share 0.5, budget 512.0 MiB, batch 44 items" in done.stdout
    assert "worker 1: share 0.25, budget 256.0 MiB, batch 12 items" in done.stdout


@pytest.mark.slow
def test_profile_refuses_shares_over_the_watermark() -> None:
    done = run_profile("--model", "synthetic", "--device", "sim", "--share", "0.5", "--share", "0.5")
    assert done.returncode == 1 and "more than the watermark 0.8" in done.stderr, done.stderr


def test_profile_table_shows_the_plan_and_a_progress_bar() -> None:
    done = run_profile("--model", "synthetic", "--device", "sim")
    assert done.returncode == 0, done.stderr
    assert "planned_batch_size             31" in done.stdout  # (409.6 - 12 - 144) / 8 = 31.7
    assert "measuring synthetic" in done.stderr and "8/8" in done.stderr  # batch sizes 1 to 8


def test_profile_names_a_budget_too_small() -> None:
    done = run_profile("--model", "synthetic", "--device", "sim", "--total-bytes", str(170 * MIB))
    assert done.returncode == 1 and "cannot hold" in done.stderr, done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--workers-per-gpu", "0"), "--workers-per-gpu: must be at least 1"),
    (("--watermark", "1.5"), "--watermark: must be a fraction in (0, 1]"),
    (("--total-bytes", "-5"), "--total-bytes: must be at least 1"),
    (("--workers-per-gpu", "2", "--share", "0.3"), "not allowed with argument --workers-per-gpu"),
])
def test_profile_refuses_bad_arguments_naming_them(args: tuple[str, ...], message: str) -> None:
    done = run_profile("--model", "synthetic", "--device", "sim", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
