"""scripts/gpu_check.sh waits for a GPU; its helpers (scripts/gpu_check.py) run here against the
simulated allocator, whose ledger gives the per-process used memory NVML gives on a GPU, so the
real check cannot rot unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, Stack, wait_until

MIB = 1024 * 1024
PARAMS = json.dumps({"batch_ms": 2, "weights_mib": 32, "fixed_mib": 4, "item_mib": 2})


def gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "scripts/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_script_parses() -> None:
    done = subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_worker_over_its_share_fails_its_check() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_check import check_workers  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    beat = {"mem_total_bytes": 1000, "memory_share": 0.4, "pid": 7, "mem_cap_bytes": 350, "mem_max_reserved_bytes": 360,
            "oom_events": 1, "mem_budget_bytes": 400, "plan_context_bytes": 50, "plan_weights_bytes": 100,
            "plan_fixed_bytes": 10, "plan_per_token_bytes": 0, "plan_batch_size": 4, "plan_batch_tokens": 0}
    checks = {name: passed for name, passed, _ in check_workers({"w": beat}, {7: 401}, expected=1)}
    assert checks == {"workers live": True, "w used <= share x total": False, "w reserved <= cap": False,
                      "w no OOM": False, "budgets <= watermark x total": True}


@pytest.mark.slow
async def test_load_and_report_pass_on_two_simulated_workers(stack: Stack, tmp_path: Path) -> None:
    """1. Two workers with shares of 0.4 on one 512 MiB simulated GPU (real processes).
    2. gpu_check.py load (50 concurrent requests), then report --sim-ledger.
    Result: both exit 0 and every check printed PASS, one line per worker and check."""
    ledger = tmp_path / "ledger"
    stack.start_gateway(served_models="synthetic")
    for i in range(2):
        stack.start_worker({"CUDA_VISIBLE_DEVICES": "0"}, model="synthetic", device="sim", memory_share=0.4,
                           sim_memory_bytes=512 * MIB, device_ledger_dir=ledger, models__synthetic__params=PARAMS,
                           worker_name=f"check-{i}")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url) as client:
        async def both() -> bool:
            return (await client.get("/v1/models/synthetic")).json()["live_workers"] == 2  # type: ignore[no-any-return]

        await wait_until(both, 60)
    load = gpu_check("load", "--url", stack.url, "--model", "synthetic", "-n", "50")
    assert load.returncode == 0 and "PASS  no request lost" in load.stdout, load.stdout + load.stderr
    report = gpu_check("report", "--url", stack.url, "--model", "synthetic", "--workers", "2",
                       "--sim-ledger", str(ledger))
    lines = report.stdout.splitlines()
    assert report.returncode == 0 and len(lines) == 8 and all(line.startswith("PASS") for line in lines), report.stdout
    assert sum("check-0" in line for line in lines) == 3 and "budgets <= watermark x total" in lines[-1]


def _gpu_check_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_check


def test_the_calibration_table_puts_the_simulation_beside_cuda_and_nvml() -> None:
    """calibration_row / render_calibration: MiB to one decimal, the ratio sim / CUDA reserved, "-"
    for what a machine cannot tell (no GPU; NVML hiding the process)."""
    gpu_check = _gpu_check_module()
    rows = [gpu_check.calibration_row("minilm", 8, 128, (160 * MIB, 172 * MIB), (128 * MIB, 600 * MIB)),
            gpu_check.calibration_row("minilm", 32, 128, (200 * MIB, 212 * MIB), (200 * MIB, None)),
            gpu_check.calibration_row("smollm2", 1, 128, (600 * MIB, 612 * MIB), None)]
    assert rows[0]["sim / cuda"] == 1.25 and rows[0]["nvml process MiB"] == 600.0
    assert rows[1]["nvml process MiB"] == "-" and rows[1]["sim / cuda"] == 1.0
    assert rows[2]["cuda max reserved MiB"] == "-" and rows[2]["sim / cuda"] == "-"
    lines = gpu_check.render_calibration(rows).splitlines()
    assert lines[0].split() == ["model", "batch", "tokens", "sim", "reserved", "MiB", "sim", "used", "MiB", "cuda",
                                "max", "reserved", "MiB", "nvml", "process", "MiB", "sim", "/", "cuda"]
    assert lines[1].split() == ["minilm", "8", "128", "160.0", "172.0", "128.0", "600.0", "1.25"]
    assert len({len(line) for line in lines}) == 1  # aligned


@pytest.mark.slow
def test_the_calibration_runs_its_simulated_part_without_a_gpu() -> None:
    """gpu_check.py calibrate on this machine: minilm at batch sizes 1 and 4, the simulated columns
    filled (more for the larger batch), CUDA's "-"."""
    done = gpu_check("calibrate", "--models", "minilm", "--batches", "1,4", "--tokens", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in rows] == [1, 4]
    assert 0 < rows[0]["sim reserved MiB"] <= rows[1]["sim reserved MiB"] < rows[1]["sim used MiB"], rows
    assert all(r["cuda max reserved MiB"] == "-" for r in rows), rows
