"""A stack's run folder and its supervisord: where it lives, whether one runs there, its logs
rotated per start, and `vramguard down` / `vramguard status` for a stack started earlier (also one
whose launcher died: supervisord runs in a session of its own and outlives it).

The run folder holds what vramguard/cli/supervisord.conf names through VG_RUN_DIR: supervisord's
pid file, control socket and log, one log per program, the generated workers.conf, and
`stack.env`, the environment supervisord was started with (so `down` and `status` reach the same
socket without the options of `up`). Logs of the previous start are moved to `previous/` when a
stack starts, so a folder never holds more than two starts' logs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SHIPPED_CONF = Path(__file__).resolve().parent / "supervisord.conf"
STACK_ENV = "stack.env"  # JSON: the environment supervisord was started with
PREVIOUS = "previous"  # the logs of the start before this one
STOP_TIMEOUT_S = 90  # supervisor stops the gateway (15 s) and the workers (20 s each, in parallel) before Redis


def state_dir() -> Path:
    """vramguard's folder in the user's state directory: $XDG_STATE_HOME/vramguard, by default
    ~/.local/state/vramguard (XDG Base Directory Specification: "state data that should persist
    between restarts", such as logs)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vramguard"


def default_run_dir(port: int | str) -> Path:
    """The run folder of the stack on `port` when no --run-dir is given: <state dir>/<port>."""
    return state_dir() / str(port)


def supervisor_command(program: str) -> list[str]:
    """supervisor's `supervisord` or `supervisorctl` run by this Python as a module: the supervisor
    installed with vramguard, wherever (or whether) its scripts are on PATH."""
    return [sys.executable, "-m", f"supervisor.{program}"]


def running_pid(run_dir: Path) -> int | None:
    """The pid of the supervisord running in `run_dir`, or None (no pid file, or its process is gone)."""
    try:
        pid = int((run_dir / "supervisord.pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def running_stacks(base: Path | None = None) -> list[Path]:
    """The run folders with a live supervisord: the default ones (every folder in the state dir) and
    those of `make up` (every folder in `base`/.run, `base` the current folder by default), in that order."""
    bases = [state_dir(), (base or Path.cwd()) / ".run"]
    found = [folder.resolve() for b in bases if b.is_dir() for folder in sorted(b.iterdir()) if folder.is_dir()]
    return [folder for folder in dict.fromkeys(found) if running_pid(folder) is not None]


def stack_on_port(port: int) -> Path | None:
    """The run folder of the running stack (of `running_stacks`) whose gateway or embedded Redis has
    `port`, from the environment it was started with; None when no such stack runs."""
    for run_dir in running_stacks():
        env = saved_env(run_dir) or {}
        if str(port) in (env.get("VRAMGUARD_PORT"), env.get("VG_REDIS_PORT") if env.get("VG_START_REDIS") == "true"
                         else None):
            return run_dir
    return None


def stack_on_gateway_port(port: int | str) -> Path | None:
    """The run folder of the running stack (of `running_stacks`) whose gateway has `port`; None
    when none does (an embedded Redis' port does not count: `down --port` names a gateway)."""
    for run_dir in running_stacks():
        if (saved_env(run_dir) or {}).get("VRAMGUARD_PORT") == str(port):
            return run_dir
    return None


def choose_stack(command: str) -> Path | int:
    """The one running stack `down` or `status` acts on without --run-dir or --port, or the exit code
    when there is not exactly one: none runs (status 3, down 0) or several do (2, listed with the
    option that names each)."""
    stacks = running_stacks()
    if len(stacks) == 1:
        return stacks[0]
    if not stacks:
        print(f"{command}: no stack runs (looked in {shlex.quote(str(state_dir()))} and ./.run)")
        return 3 if command == "status" else 0
    print(f"{command}: {len(stacks)} stacks run; name one:")
    for run_dir in stacks:
        port = (saved_env(run_dir) or {}).get("VRAMGUARD_PORT", "?")
        print(f"  {command} --run-dir {shlex.quote(str(run_dir))}   (gateway port {port})")
    return 2


def rotate_logs(run_dir: Path) -> None:
    """Move the logs of the last start (every *.log and supervisor's rotated *.log.N) into
    `previous/`, replacing the ones there: each start begins with empty logs."""
    previous = run_dir / PREVIOUS
    shutil.rmtree(previous, ignore_errors=True)
    logs = [p for p in run_dir.glob("*.log*") if p.is_file()]
    if logs:
        previous.mkdir(parents=True)
        for path in logs:
            path.rename(previous / path.name)


def save_env(run_dir: Path, env: dict[str, str]) -> None:
    """Keep supervisord's environment in the run folder for `down` and `status`. It holds the
    user's environment, VRAMGUARD_API_KEY and any other secret in it included: readable by its
    owner only (mode 0600, also when the file was there before), and removed once the stack stops
    (`forget_env`)."""
    path = run_dir / STACK_ENV
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an older start keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(env))


def forget_env(run_dir: Path) -> None:
    """Remove the saved environment of a stack that has stopped (nothing reads it any more)."""
    (run_dir / STACK_ENV).unlink(missing_ok=True)


def saved_env(run_dir: Path) -> dict[str, str] | None:
    """The environment `up` started supervisord with in `run_dir`, or None when no stack started there."""
    try:
        data = json.loads((run_dir / STACK_ENV).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ctl(run_dir: Path, env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    """`supervisorctl <command>` against the stack of `run_dir` (its socket, through `env`)."""
    return subprocess.run([*supervisor_command("supervisorctl"), "-c", str(SHIPPED_CONF), *command], env=env,
                          capture_output=True, text=True, check=False, timeout=60)


def program_states(run_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """group:process -> supervisor's state word (RUNNING, STARTING, BACKOFF, FATAL, EXITED...), from
    `supervisorctl status`; empty when supervisord does not answer."""
    out = ctl(run_dir, env, "status").stdout
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isupper():
            states[parts[0]] = parts[1]
    return states


def status(run_dir: Path) -> int:
    """`vramguard status`: print the stack's programs and their states. Exit codes: 0 the stack runs,
    3 no stack runs in `run_dir` (the LSB convention for "program is not running")."""
    env = saved_env(run_dir)
    pid = running_pid(run_dir)
    if env is None or pid is None:
        print(f"status: no stack runs in {shlex.quote(str(run_dir))}")
        return 3
    print(f"status: supervisord pid {pid}, run folder {shlex.quote(str(run_dir))}, "
          f"gateway port {env.get('VRAMGUARD_PORT', '?')}")
    print(ctl(run_dir, env, "status").stdout.rstrip())
    return 0


def down(run_dir: Path) -> int:
    """`vramguard down`: stop the stack of `run_dir` (supervisor stops the gateway, the workers,
    then Redis) and wait until supervisord has exited. Exit codes: 0 stopped (or nothing ran),
    1 it did not stop within STOP_TIMEOUT_S."""
    pid = running_pid(run_dir)
    if pid is None:
        forget_env(run_dir)
        print(f"down: no stack runs in {shlex.quote(str(run_dir))}")
        return 0
    os.kill(pid, signal.SIGTERM)  # supervisord stops every program in reverse priority order, then exits
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if running_pid(run_dir) is None:
            forget_env(run_dir)
            print(f"down: stopped the stack in {shlex.quote(str(run_dir))}")
            return 0
        time.sleep(0.2)
    print(f"down: supervisord (pid {pid}) did not stop in {STOP_TIMEOUT_S} s; see "
          f"{shlex.quote(str(run_dir / 'supervisord.log'))}", file=sys.stderr)
    return 1
