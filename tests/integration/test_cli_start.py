"""What a newcomer sees of `vramguard up` / `status` / `down` / `check`, on one real stack shared by
the module (the synthetic model, real supervisord, Redis, gateway and worker), started as a user
would: no --run-dir (its folder is the state dir's), from a folder of its own. While it starts, `up`
says what the worker does, and nothing of supervisor's own log reaches the terminal; `status` and
`down` without --port find the only stack that runs, and list several rather than choose; `check`
names the stack that holds the port it would use."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port, wait_until
from tests.integration.test_cli_stack import cli_env
from vramguard.cli.stack import SHIPPED_CONF, running_pid

pytestmark = pytest.mark.integration

READY_S = 150


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    out: Path
    home: Path  # the folder the commands run in; its ./.run is where `make up` would put stacks
    env: dict[str, str]
    port: int
    redis_port: int

    @property
    def run_dir(self) -> Path:
        return (self.home / "state" / "vramguard" / str(self.port)).resolve()

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vramguard.cli", *args], cwd=self.home, env=self.env,
                              capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """`vramguard up --model synthetic` with the state dir in a temporary folder, ready."""
    home = tmp_path_factory.mktemp("home")
    env = {**cli_env(), "XDG_STATE_HOME": str(home / "state"), "PYTHONPATH": str(ROOT)}
    out = home / "up.out"
    port, redis_port = free_port(), free_port()
    with out.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "vramguard.cli", "up", "--model", "synthetic", "--port",
                                 str(port), "--redis-port", str(redis_port)], cwd=home, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    up = Started(proc, out, home, env, port, redis_port)
    try:
        asyncio.run(wait_until(lambda: "vramguard is ready at" in up.text() or proc.poll() is not None, READY_S))
        assert proc.poll() is None, up.text()[-3000:]
        yield up
    finally:
        up.cli("down", "--run-dir", str(up.run_dir))
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_up_says_what_the_worker_does_while_it_starts(started: Started) -> None:
    """The worker's own steps (loading, warm-up, each batch size measured, its memory plan) are
    progress lines before 'ready', in that order."""
    before_ready = started.text().split("vramguard is ready at")[0]
    steps = ["loading the weights", "warm-up: the model's example inputs", "measured the memory of a batch size 1",
             "warmup done in ", "memory plan", "worker ready"]
    at = [before_ready.find(f"up: worker-synthetic-cpu-0: {step}") for step in steps]
    assert -1 not in at and at == sorted(at), (steps, at, before_ready)


def test_a_start_shows_none_of_supervisors_own_log(started: Started) -> None:
    """No CRIT line (running as root, no HTTP authentication), no spawned/success lines: they are in
    supervisord.log, not on the terminal."""
    said = started.text()
    assert not [line for line in said.splitlines() if not line.startswith(("up: ", "  ", "vramguard is ready",
                                                                            "Ctrl-C stops it"))
                and line.strip()], said
    assert "CRIT" not in said and "spawned:" not in said and "success:" not in said, said
    assert "spawned: 'gateway-0'" in (started.run_dir / "supervisord.log").read_text()


def test_status_without_a_port_shows_the_only_stack(started: Started) -> None:
    shown = started.cli("status")
    assert shown.returncode == 0, shown
    assert f"run folder {started.run_dir}" in shown.stdout and "gateway-0" in shown.stdout, shown


def test_check_names_the_stack_that_holds_its_ports(started: Started) -> None:
    checked = started.cli("check", "--model", "synthetic", "--port", str(started.port), "--redis-port",
                          str(started.redis_port))
    assert checked.returncode == 1, checked
    for what, port in (("gateway", started.port), ("embedded Redis", started.redis_port)):
        assert f"FAIL port {port} ({what}) is used by the vramguard stack in {started.run_dir}: " in checked.stdout, \
            checked
    assert "stop what listens there" not in checked.stdout, checked


def test_status_and_down_list_several_stacks_and_choose_none(started: Started) -> None:
    """1. A second supervisord (no programs) runs in ./.run/<port>, where `make up` puts its stacks.
    2. `status`, then `down`, without --port.
    Result: each exits 2 listing both run folders with the option that names each; both still run."""
    other = started.home / ".run" / "18799"
    other.mkdir(parents=True)
    (other / "workers.conf").write_text("")
    env = {**started.env, "VG_RUN_DIR": str(other), "VG_PYTHON": sys.executable, "VG_ROOT": str(ROOT),
           "VG_REDIS_SERVER": "redis-server", "VG_REDIS_PORT": "0", "VG_START_REDIS": "false",
           "VG_START_GATEWAY": "false", "VG_GATEWAYS": "1"}
    bare = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(SHIPPED_CONF), "--silent"],
                            env=env, start_new_session=True)
    try:
        asyncio.run(wait_until(lambda: running_pid(other) is not None or bare.poll() is not None, 60))
        assert bare.poll() is None
        for command in ("status", "down"):
            listed = started.cli(command)
            assert listed.returncode == 2, listed
            assert f"{command} --run-dir {started.run_dir}" in listed.stdout, listed
            assert f"{command} --run-dir {other.resolve()}" in listed.stdout, listed
        assert running_pid(other) is not None and running_pid(started.run_dir) is not None
    finally:
        bare.send_signal(signal.SIGTERM)
        bare.wait(timeout=60)


def test_down_without_a_port_stops_the_only_stack(started: Started) -> None:
    """Last in the module: it stops the shared stack."""
    supervisord = running_pid(started.run_dir)
    assert supervisord is not None
    stopped = started.cli("down")
    assert stopped.returncode == 0 and f"stopped the stack in {started.run_dir}" in stopped.stdout, stopped
    started.proc.wait(timeout=60)  # the launcher has reaped supervisord
    # the terminal of `up` says why it returned to the prompt, not only the ready banner
    assert started.proc.returncode == 0, started.text()[-3000:]
    assert started.text().rstrip().endswith(f"up: the stack in {started.run_dir} has stopped"), started.text()[-3000:]
    with pytest.raises(ProcessLookupError):
        os.kill(supervisord, 0)
