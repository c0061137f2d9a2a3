"""`make up GPUS=0,1 WORKERS_PER_GPU=2` on a host with two simulated GPUs, for real: deploy/up.py
starts the shipped deploy/supervisord.conf with its generated worker programs, and every worker
process's own environment (/proc/<pid>/environ) says which GPU it is pinned to and its share."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, RedisServer, free_port, wait_until

WATERMARK = 0.8


def children(parent: int) -> list[int]:
    """Pids whose parent is `parent`, from /proc/<pid>/stat."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == parent:
            out.append(int(stat.parent.name))
    return out


def worker_environments(supervisord_pid: int) -> dict[int, dict[str, str]]:
    """pid -> environment of every `python -m worker` child of supervisord."""
    found = {}
    for pid in children(supervisord_pid):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in cmdline and b"-m" in cmdline:
            found[pid] = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    return found


@pytest.fixture
def launched(redis_server: RedisServer, key_prefix: str) -> Iterator[tuple[str, Path]]:
    """deploy/up.py --model synthetic --gpus 0,1 --workers-per-gpu 2 with VRAMGUARD_SIM_GPUS=2 on
    the session's Redis. Yields (gateway URL, run dir); stopped with SIGTERM, as Ctrl-C does."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(VRAMGUARD_SIM_GPUS="2", VRAMGUARD_PORT=str(port), VRAMGUARD_REDIS_URL=redis_server.url,
               VRAMGUARD_KEY_PREFIX=key_prefix, VRAMGUARD_HEARTBEAT_INTERVAL_MS="200",
               VRAMGUARD_HEARTBEAT_TTL_MS="1500", VRAMGUARD_BLOCK_MS="200")
    run_dir = ROOT / ".run" / str(port)
    proc = subprocess.Popen([sys.executable, "deploy/up.py", "--model", "synthetic", "--gpus", "0,1",
                             "--workers-per-gpu", "2"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", run_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def run_logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(run_dir.glob("*.log")))


@pytest.mark.slow
async def test_two_gpus_two_workers_each_are_pinned_named_and_shares_add_up(launched: tuple[str, Path]) -> None:
    """1. make up GPUS=0,1 WORKERS_PER_GPU=2 on two simulated GPUs; the stack becomes ready.
    2. Each worker process's environment is read from /proc/<pid>/environ.
    3. One worker is SIGKILLed; supervisor starts a fresh process.
    Result: four workers, two per GPU, each with CUDA_VISIBLE_DEVICES = its own GPU, named
    host-synthetic-gpu<i>-<slot>, shares adding up to at most the watermark per GPU; the
    restarted process has the same name and GPU."""
    url, run_dir = launched
    async with httpx.AsyncClient(base_url=url) as client:

        async def ready() -> bool:
            try:
                return (await client.get("/health/ready")).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            await wait_until(ready, 120, interval_s=0.3)
        except AssertionError:
            raise AssertionError(f"not ready:\n{run_logs(run_dir)}") from None
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
