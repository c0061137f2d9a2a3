"""`make up GPUS=0,1 WORKERS_PER_GPU=2` on a host with two simulated GPUs, for real: deploy/up.py
starts the shipped deploy/supervisord.conf with its generated worker programs, and every worker
process's own environment (/proc/<pid>/environ) says which GPU it is pinned to and its share."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from tests.chaos.load import Load
from tests.helpers import ROOT, RedisServer, free_port, wait_until

WATERMARK = 0.8


def children(parent: int) -> list[int]:
    """Pids whose parent is `parent`."""
    try:
        return [child.pid for child in psutil.Process(parent).children()]
    except psutil.NoSuchProcess:
        return []


def worker_environments(supervisord_pid: int) -> dict[int, dict[str, str]]:
    """pid -> environment of every `python -m vramguard.worker` child of supervisord."""
    found = {}
    for pid in children(supervisord_pid):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vramguard.worker" in cmdline and b"-m" in cmdline:
            found[pid] = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    return found


@contextmanager
def launch(redis_url: str, key_prefix: str, *args: str, **settings: str) -> Iterator[tuple[str, Path]]:
    """deploy/up.py `args` with VRAMGUARD_SIM_GPUS=2 on the session's Redis, plus `settings` as
    VRAMGUARD_<NAME> (a device_ledger_dir of its own keeps its simulated GPUs apart from other
    runs). Yields (gateway URL, run dir) once /health/ready answers 200; stopped with SIGTERM,
    as Ctrl-C does."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(VRAMGUARD_SIM_GPUS="2", VRAMGUARD_PORT=str(port), VRAMGUARD_REDIS_URL=redis_url,
               VRAMGUARD_KEY_PREFIX=key_prefix, VRAMGUARD_HEARTBEAT_INTERVAL_MS="200",
               VRAMGUARD_HEARTBEAT_TTL_MS="1500", VRAMGUARD_BLOCK_MS="200")
    env.update({f"VRAMGUARD_{k.upper()}": v for k, v in settings.items()})
    run_dir = ROOT / ".run" / str(port)
    proc = subprocess.Popen([sys.executable, "deploy/up.py", "--run-dir", str(run_dir), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(f"{url}/health/ready", 120)
        except AssertionError:
            raise AssertionError(f"not ready:\n{run_logs(run_dir)}") from None
        yield url, run_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def wait_http_ok(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not 200 within {timeout_s} s")


def run_logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(run_dir.glob("*.log")))


@pytest.mark.slow
async def test_two_gpus_two_workers_each_are_pinned_named_and_shares_add_up(redis_server: RedisServer,
                                                                          key_prefix: str, tmp_path: Path) -> None:
    """1. make up GPUS=0,1 WORKERS_PER_GPU=2 on two simulated GPUs; the stack becomes ready.
    2. Each worker process's environment is read from /proc/<pid>/environ.
    3. One worker is SIGKILLed; supervisor starts a fresh process.
    Result: four workers, two per GPU, each with CUDA_VISIBLE_DEVICES = its own GPU, named
    host-synthetic-gpu<i>-<slot>, shares adding up to at most the watermark per GPU; the
    restarted process has the same name and GPU."""
    with launch(redis_server.url, key_prefix, "--model", "synthetic", "--gpus", "0,1",
                "--workers-per-gpu", "2", device_ledger_dir=str(tmp_path / "ledger")) as (_, run_dir):
        await check_pinned_and_restarted(run_dir)


async def check_pinned_and_restarted(run_dir: Path) -> None:
    supervisord = int((run_dir / "supervisord.pid").read_text())
    envs = worker_environments(supervisord)
    host = platform.node()
    names = {e["VRAMGUARD_WORKER_NAME"]: e for e in envs.values()}
    assert sorted(names) == sorted(f"{host}-synthetic-gpu{g}-{s}" for g in (0, 1) for s in (0, 1))
    for name, env in names.items():
        assert env["CUDA_VISIBLE_DEVICES"] == name.split("-gpu")[1].split("-")[0]
        assert env["VRAMGUARD_WORKERS_PER_GPU"] == "2" and env["VRAMGUARD_DEVICE"] == "sim"
    for gpu in ("0", "1"):
        shares = [float(e["VRAMGUARD_MEMORY_SHARE"]) for e in envs.values() if e["CUDA_VISIBLE_DEVICES"] == gpu]
        assert len(shares) == 2 and sum(shares) <= WATERMARK

    victim, victim_env = next((pid, e) for pid, e in envs.items() if e["VRAMGUARD_WORKER_NAME"].endswith("gpu1-1"))
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        now = worker_environments(supervisord)
        return len(now) == 4 and victim not in now

    await wait_until(replaced, 60, interval_s=0.2)
    (new_env,) = [e for e in worker_environments(supervisord).values()
                  if e["VRAMGUARD_WORKER_NAME"] == victim_env["VRAMGUARD_WORKER_NAME"]]
    assert new_env["CUDA_VISIBLE_DEVICES"] == "1"
    assert new_env["VRAMGUARD_MEMORY_SHARE"] == victim_env["VRAMGUARD_MEMORY_SHARE"]


PLACEMENT_3_2 = """\
[[model]]
name = "synthetic"
gpus = [0]
workers = 3

[[model]]
name = "synthetic"
gpus = [1]
workers = 2
"""
LOAD_CLIENTS = 200
LOAD_S = 15.0
MIB = 1024 * 1024


@pytest.mark.slow
@pytest.mark.timeout(300)  # five workers import torch at once on two busy cores; up waits for all of them
async def test_three_and_two_workers_on_two_gpus_under_200_clients(redis_server: RedisServer, key_prefix: str,
                                                                   tmp_path: Path) -> None:
    """1. make up PLACEMENT=... on two simulated GPUs of 512 MiB: 3 synthetic workers on GPU 0,
       2 on GPU 1 (per-item simulated memory, batches up to 64).
    2. 200 closed-loop clients for 15 s.
    Result: every request answered 200 with its own output, no OOM event, every worker's
    CUDA_VISIBLE_DEVICES (read from the process) is its own GPU, and on each GPU the workers'
    peaks add up to at most watermark x the GPU's total."""
    placement = tmp_path / "placement.toml"
    placement.write_text(PLACEMENT_3_2)
    params = {"batch_ms": 5, "item_ms": 0.1, "weights_mib": 16, "fixed_mib": 4, "item_mib": 2}
    with launch(redis_server.url, key_prefix, "--placement", str(placement), sim_memory_bytes=str(512 * MIB),
                device_ledger_dir=str(tmp_path / "ledger"), models__synthetic__params=json.dumps(params),
                models__synthetic__max_batch_size="64") as (url, run_dir):
        envs = worker_environments(int((run_dir / "supervisord.pid").read_text()))
        assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs.values()) == ["0", "0", "0", "1", "1"]
        for env in envs.values():
            assert f"-gpu{env['CUDA_VISIBLE_DEVICES']}-" in env["VRAMGUARD_WORKER_NAME"]
        async with Load(url, clients=LOAD_CLIENTS) as load:
            tally = await load.run_for(LOAD_S)
        async with httpx.AsyncClient(base_url=url) as client:
            beats = (await client.get("/v1/models/synthetic")).json()["workers"]
    per_gpu = {gpu: [b for name, b in beats.items() if f"-gpu{gpu}-" in name] for gpu in ("0", "1")}
    peaks = {gpu: sum(int(b["mem_peak_bytes"]) for b in on_gpu) for gpu, on_gpu in per_gpu.items()}
    print(f"[placement] 3+2 workers, {LOAD_CLIENTS} clients x {LOAD_S:g} s: sent={tally.sent} 200={tally.ok} "
          f"errors={dict(tally.errors)} lost={tally.lost} peak MiB per GPU={ {g: p // MIB for g, p in peaks.items()} }")
    assert tally.sent > LOAD_CLIENTS and tally.ok == tally.sent, dict(tally.errors)
    tally.assert_each_answered_with_its_own()
    assert len(beats) == 5 and [len(per_gpu["0"]), len(per_gpu["1"])] == [3, 2]
    for gpu, on_gpu in per_gpu.items():
        assert sum(int(b["oom_events"]) for b in on_gpu) == 0
        assert peaks[gpu] <= WATERMARK * int(on_gpu[0]["mem_total_bytes"]), (gpu, peaks)
    # Every worker on a GPU has the plan its share gives, whatever order supervisor started them in:
    # floor((share x 512 - 12 outside the allocator - 16 weights - 18 fixed) / 2 per item), capped at 64;
    # fixed is 18, not 4: a forward of 1 or 2 items (6-8 MiB) takes a 20 MiB segment of the allocator.
    for gpu, n in (("0", 3), ("1", 2)):
        share = math.floor(WATERMARK / n * 1e6) / 1e6  # make up writes shares rounded down to 6 decimals
        expected = min(64, math.floor((share * 512 - 12 - 16 - 18) / 2))
        assert {b["plan_batch_size"] for b in per_gpu[gpu]} == {expected}, per_gpu[gpu]


@pytest.mark.slow
@pytest.mark.timeout(300)  # two starts in a row, each waiting for all its workers on two busy cores
def test_workers_that_keep_failing_at_start_are_reported_and_the_stack_stops(redis_server: RedisServer,
                                                                             key_prefix: str, tmp_path: Path) -> None:
    """1. make up MODEL=synthetic WORKERS_PER_GPU=3 on one simulated GPU of 512 MiB: each worker's
       share (0.8 / 3 = 136.5 MiB) cannot hold its 128 MiB of weights + 16 MiB + one item.
    2. The workers exit 3 at start, again and again: they fail after supervisor's startsecs, so
       supervisor itself never gives up.
    3. The user fixes the cause (WORKERS_PER_GPU=2) and runs make up again on the same port, so in
       the same run dir, whose logs still hold the first run's failures.
    Result: make up names the failing workers and the memory reason from their logs, stops the stack
    and exits non-zero well before its readiness timeout; the second run is not confused by the
    first run's logs: it becomes ready and prints a request for the model."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(VRAMGUARD_SIM_GPUS="1", VRAMGUARD_PORT=str(free_port()), VRAMGUARD_REDIS_URL=redis_server.url,
               VRAMGUARD_KEY_PREFIX=key_prefix, VRAMGUARD_DEVICE_LEDGER_DIR=str(tmp_path / "ledger"))
    started = time.monotonic()
    run_dir = ROOT / ".run" / env["VRAMGUARD_PORT"]
    done = subprocess.run([sys.executable, "deploy/up.py", "--model", "synthetic", "--workers-per-gpu", "3",
                           "--run-dir", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    supervisord = int((run_dir / "supervisord.pid").read_text()) if (run_dir / "supervisord.pid").exists() else None
    log = (run_dir / "supervisord.log").read_text(errors="replace")
    try:
        assert done.returncode == 1, done.stdout[-3000:]
        assert "worker-synthetic-gpu0-" in done.stdout and "cannot start" in done.stdout, done.stdout[-3000:]
        assert "memory budget too small" in done.stdout and "cannot hold" in done.stdout, done.stdout[-3000:]
        assert "cannot use Redis" not in done.stdout and "not ready; stopping" in done.stdout, done.stdout[-3000:]
        assert time.monotonic() - started < 200
        assert "exit status 3" in log and "stopped: gateway" in log  # it stopped everything it ran
        if supervisord is not None:  # supervisord removes its pid file on a clean exit
            with pytest.raises(ProcessLookupError):
                os.kill(supervisord, 0)
        assert ready_after_fix(env, run_dir) == (
            f"curl -s -X POST http://127.0.0.1:{env['VRAMGUARD_PORT']}/v1/models/synthetic/infer "
            """-H 'Content-Type: application/json' -d '{"inputs": [1, "two"]}'""")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def ready_after_fix(env: dict[str, str], run_dir: Path) -> str:
    """make up with 2 workers per GPU in `run_dir`; returns the request line it prints once ready."""
    out = run_dir / "second-up.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "deploy/up.py", "--model", "synthetic", "--workers-per-gpu", "2",
                                 "--run-dir", str(run_dir)], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "Ctrl-C stops it" not in out.read_text(errors="replace"):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
                time.sleep(0.3)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return next(line.strip() for line in out.read_text().splitlines() if line.strip().startswith("curl"))
