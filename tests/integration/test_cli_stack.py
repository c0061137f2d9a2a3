"""`vramguard up` / `down` / `status` on a run folder, for real (the synthetic model, real supervisord,
Redis, gateway and workers): a hang-up of the terminal stops the whole stack; a stack whose launcher
died is shown and stopped from its run folder, by the stop command the launcher printed; the saved
environment is its owner's alone and gone once the stack stops; each start rotates the folder's logs; the launcher is
ready only when every placed worker is, and otherwise stops with the failing worker's own error; a
late external Redis is waited for."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, RedisServer, free_port

pytestmark = pytest.mark.integration

READY_S = 150


def cli_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(HF_HUB_OFFLINE="1", VRAMGUARD_HEARTBEAT_INTERVAL_MS="200", VRAMGUARD_HEARTBEAT_TTL_MS="1500")
    env.update({f"VRAMGUARD_{k.upper()}": v for k, v in settings.items()})
    return env


def vramguard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramguard.cli", *args], cwd=ROOT, env=env or cli_env(),
                          capture_output=True, text=True, timeout=180)


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    out: Path
    run_dir: Path
    port: int

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, words: str, timeout_s: float = READY_S) -> None:
        deadline = time.monotonic() + timeout_s
        while words not in self.text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.3)

    def supervisord_pid(self) -> int:
        return int((self.run_dir / "supervisord.pid").read_text())


@contextmanager
def launch(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Up]:
    """`vramguard up --model synthetic` in its own process group (as a shell runs a foreground job);
    whatever is left at the end is stopped through `vramguard down`."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "vramguard.cli", "up", "--model", "synthetic",
                                 "--port", str(port), "--redis-port", str(free_port()), "--run-dir", str(run_dir),
                                 *args], cwd=ROOT, env=env or cli_env(), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield Up(proc, out, run_dir, port)
    finally:
        vramguard("down", "--run-dir", str(run_dir))
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def gone(pid: int, timeout_s: float = 90) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def program_pids(up: Up) -> list[int]:
    """The pids of the stack's programs (Redis, gateway, worker), from supervisorctl."""
    listed = vramguard("status", "--run-dir", str(up.run_dir)).stdout
    return [int(line.split("pid ")[1].split(",")[0]) for line in listed.splitlines() if " RUNNING " in line]


def worker_pid(up: Up) -> int:
    listed = vramguard("status", "--run-dir", str(up.run_dir)).stdout
    return next(int(line.split("pid ")[1].split(",")[0]) for line in listed.splitlines()
                if line.startswith("worker-") and " RUNNING " in line)


def wait_for_exit_on_status_page(port: int, words: str, timeout_s: float = 60) -> bool:
    """Whether /status.json shows a worker whose last exit says `words` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"http://127.0.0.1:{port}/status.json", timeout=10).json()
        if any(words in (w.get("last_exit") or "") for m in status["models"] for w in m["workers"]):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.timeout(300)  # stacks start on two busy cores
def test_down_and_status_of_a_stack_whose_launcher_died_then_a_hang_up_stops_the_next(tmp_path: Path) -> None:
    """1. `vramguard up` in a run folder; once ready its launcher is SIGKILLed (supervisord, in a
       session of its own, keeps the stack running).
    2. `vramguard status` and `vramguard down` on the run folder, then `status` again.
    3. `vramguard up` again in the same folder; once ready, its worker is SIGKILLed; then SIGHUP to
       the launcher's process group, as a terminal that is closed sends it.
    Result: status shows the running programs (exit 0), down stops every one of them, status then
    says none runs (exit 3); the second start begins with fresh logs, the first start's are in
    previous/; the status page shows the killed worker's last exit; the hang-up stops the whole
    second stack (launcher, supervisord, every program)."""
    run_dir = tmp_path / "run"
    with launch(run_dir) as first:
        first.wait_for("vramguard is ready at")
        first_supervisord, programs = first.supervisord_pid(), program_pids(first)
        first.proc.kill()
        first.proc.wait(timeout=30)
        shown = vramguard("status", "--run-dir", str(run_dir))
        assert shown.returncode == 0 and "gateway-0" in shown.stdout and "RUNNING" in shown.stdout, shown
        assert len(programs) == 3  # redis, gateway, one worker
        # The saved environment holds the user's (secrets included): its owner's alone.
        assert (run_dir / "stack.env").stat().st_mode & 0o777 == 0o600
        # The stop command the launcher printed, run as printed (from any directory, any PATH).
        printed = first.text().split("from another terminal: ")[1].split(").")[0]
        stopped = subprocess.run(shlex.split(printed), cwd=tmp_path, env={**cli_env(), "PATH": "/usr/bin:/bin"},
                                 capture_output=True, text=True, timeout=180)
        assert stopped.returncode == 0 and "stopped the stack" in stopped.stdout, (printed, stopped)
        assert all(gone(pid, 10) for pid in [first_supervisord, *programs])
        assert not (run_dir / "stack.env").exists()
        assert vramguard("status", "--run-dir", str(run_dir)).returncode == 3
    with launch(run_dir) as second:
        second.wait_for("vramguard is ready at")
        previous = (run_dir / "previous" / "supervisord.log").read_text()
        assert f"supervisord started with pid {first_supervisord}" in previous
        assert f"with pid {first_supervisord}" not in (run_dir / "supervisord.log").read_text()
        os.kill(worker_pid(second), signal.SIGKILL)
        assert wait_for_exit_on_status_page(second.port, "terminated by SIGKILL")
        supervisord, programs = second.supervisord_pid(), program_pids(second)
        os.killpg(second.proc.pid, signal.SIGHUP)
        second.proc.wait(timeout=90)
        assert all(gone(pid) for pid in [supervisord, *programs]), second.text()[-2000:]
        assert not (run_dir / "stack.env").exists()  # the launcher removed it once the stack stopped
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{second.port}/health/live", timeout=5)


@pytest.mark.slow
@pytest.mark.timeout(300)  # stacks start on two busy cores
def test_not_ready_while_a_placed_worker_cannot_start_and_its_error_is_shown(tmp_path: Path) -> None:
    """1. A placement of synthetic on two simulated GPUs of 512 MiB: a worker on GPU 0 with a share of
       0.4 (enough), one on GPU 1 with 0.2 (102 MiB, less than the 144 MiB one needs).
    2. `vramguard up --placement` it.
    Result: the model is served by GPU 0's workers, so the gateway alone would be ready; the launcher
    never says ready, names GPU 1's workers with their own error, stops the stack and exits 1."""
    placement = tmp_path / "placement.toml"
    placement.write_text('[[model]]\nname = "synthetic"\ngpus = [0]\nshare = 0.4\n\n'
                         '[[model]]\nname = "synthetic"\ngpus = [1]\nshare = 0.2\n')
    env = cli_env(sim_gpus="2", device_ledger_dir=str(tmp_path / "ledger"))
    with launch(tmp_path / "run", "--placement", str(placement), env=env) as up:
        assert up.proc.wait(timeout=READY_S) == 1, up.text()[-3000:]
        said = up.text()
        assert "vramguard is ready" not in said, said[-3000:]
        assert "worker-synthetic-gpu1" in said and "cannot start" in said, said[-3000:]
        assert "memory budget too small" in said and "not ready; stopping" in said, said[-3000:]
        assert "worker-synthetic-gpu0" not in said.split("cannot start")[0].splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)  # stacks start on two busy cores
def test_a_late_external_redis_is_waited_for(tmp_path: Path) -> None:
    """1. `vramguard up` with VRAMGUARD_REDIS_URL naming a port where no Redis runs yet.
    2. The launcher says what it waits for; the workers exit (Redis is not there) twice or more.
    3. Redis starts on that port.
    Result: the launcher becomes ready and the stack answers a request."""
    redis = RedisServer()
    env = cli_env(redis_url=redis.url)
    try:
        with launch(tmp_path / "run", env=env) as up:
            up.wait_for(f"waiting for Redis at {redis.url} to answer", 60)
            log = up.run_dir / "supervisord.log"
            deadline = time.monotonic() + 90
            while log.read_text(errors="replace").count("exited: worker-synthetic-cpu-0") < 2:
                assert up.proc.poll() is None and time.monotonic() < deadline, up.text()[-3000:]
                time.sleep(0.3)
            redis.start()
            up.wait_for("vramguard is ready at")
            reply = httpx.post(f"http://127.0.0.1:{up.port}/v1/models/synthetic/infer", json={"inputs": [1]},
                               timeout=30)
            assert reply.status_code == 200 and reply.json()["outputs"] == [1], reply.text
    finally:
        redis.stop()
