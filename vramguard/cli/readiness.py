"""When a starting stack is ready, and when it cannot start (`vramguard up`).

Ready means: the gateway's /health/ready answers 200 AND every worker process of the placement
has a fresh heartbeat saying it is ready. The gateway alone is not enough: it is ready as soon
as each model has one live worker, so a placement whose workers on one GPU crash-loop would pass.

A program that cannot start stops the launcher at once with that program's own logged error.
Supervisor only gives up on a program (FATAL) when it dies within `startsecs`; a worker imports
torch and loads weights first, so most start failures look like a crash loop of "running"
processes instead, and two unexpected exits of one process are the launcher's sign. Exits
while Redis does not answer do not count: the workers exit because Redis is late, not because
they cannot start; the launcher says it is waiting for Redis, up to `redis_wait_s`.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
from redis.exceptions import RedisError

from vramguard.cli import placed
from vramguard.cli.placed import placement_record
from vramguard.cli.placement import WorkerGroup
from vramguard.cli.stack import program_states
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import Keys
from vramguard.shared.redis_client import connect
from vramguard.shared.settings import Settings, mask_url_password

READY_TIMEOUT_S = 600  # first start on a slow machine imports torch and loads weights
REDIS_WAIT_S = 120  # how long a late Redis is waited for (--redis-wait-s)
POLL_S = 0.5
CHECK_EVERY = 6  # supervisor and Redis are asked every 6 polls, ~3 s

# "exited: worker-synthetic-gpu0-1 (exit status 3; not expected)" in supervisord's log.
EXITED = re.compile(r"exited: (\S+) \(exit status (\d+); not expected\)")

Say = Callable[[str], None]


def placed_workers(groups: list[WorkerGroup]) -> list[str]:
    """The consumer names every worker process of the placement will have: host-model-device-slot."""
    return list(placement_record(groups))


async def _probe(settings: Settings, worker_ids: list[str]) -> dict[str, WorkerBeat]:
    """PING Redis, then the heartbeat of each of `worker_ids` that has one. Raises RedisError or
    TimeoutError when Redis does not answer."""
    redis = connect(settings)
    keys = Keys(settings.key_prefix)
    try:
        await asyncio.wait_for(redis.ping(), timeout=2.0)
        beats = {}
        for worker_id in worker_ids:
            raw = cast(dict[bytes, bytes], await asyncio.wait_for(redis.hgetall(keys.heartbeat(worker_id)), 2.0))
            if raw:
                beats[worker_id] = WorkerBeat.from_hash(raw)
        return beats
    finally:
        await redis.aclose()


def worker_beats(settings: Settings, worker_ids: list[str]) -> dict[str, WorkerBeat] | None:
    """Heartbeats of `worker_ids` by id, or None when Redis does not answer."""
    try:
        return asyncio.run(_probe(settings, worker_ids))
    except (RedisError, OSError, TimeoutError):
        return None


def log_marks(run_dir: Path) -> dict[Path, int]:
    """The size of every log in `run_dir` now."""
    return {path: path.stat().st_size for path in run_dir.glob("*.log")}


def read_since(path: Path, marks: dict[Path, int]) -> str:
    """What was appended to `path` after `marks` were taken ('' when the file does not exist)."""
    try:
        with path.open("rb") as f:
            start = marks.get(path, 0)
            if start > path.stat().st_size:  # rotated since: all of it is new
                start = 0
            f.seek(start)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def failing_at_start(run_dir: Path, marks: dict[Path, int]) -> list[str]:
    """Processes that exited unexpectedly at least twice since `marks`, from supervisord's log."""
    counts: dict[str, int] = {}
    for name, _status in EXITED.findall(read_since(run_dir / "supervisord.log", marks)):
        counts[name] = counts.get(name, 0) + 1
    return [name for name, n in counts.items() if n >= 2]


def logged_errors(log: str) -> list[str]:
    """The distinct ERROR and CRITICAL messages of a JSON-lines log, in order, each with its `error` field,
    else the last line of its traceback."""
    reasons: list[str] = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("level") in ("ERROR", "CRITICAL"):
            # An exception nobody caught ("uncaught exception") carries its cause only in the
            # traceback, whose last line is the exception itself.
            traceback = str(event.get("exc_info") or "").strip()
            cause = event.get("error") or (traceback.splitlines()[-1] if traceback else "")
            reason = f"{event.get('message')}: {cause}".rstrip(": ")
            if reason not in reasons:
                reasons.append(reason)
    return reasons


def report_failing(names: list[str], run_dir: Path, say: Say) -> None:
    """Say which programs cannot start and why: the last distinct errors each logged (its last
    lines when it logged none, a traceback say)."""
    for name in names:
        log_path = run_dir / f"{name.split(':')[-1]}.log"
        say(f"up: {name} cannot start; see {shlex.quote(str(log_path))}")
        text = read_since(log_path, {})
        reasons = logged_errors(text)[-3:] or [line for line in text.splitlines() if line.strip()][-3:]
        for reason in reasons:
            say(f"    {reason[:400]}")


def progress_lines(log: str) -> list[str]:
    """The messages of a JSON-lines log's INFO and WARNING events, cut to 200 characters; a `step`
    field reads ' k' (' k/n' with a `steps` field), a `duration_ms` field ' in N s'. Lines that are not JSON
    (a library writing to the log on its own) are left out."""
    lines = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("level") not in ("INFO", "WARNING"):
            continue
        said = str(event.get("message", ""))
        if "step" in event:
            said += f" {event['step']}" + (f"/{event['steps']}" if "steps" in event else "")
        if isinstance(event.get("duration_ms"), int | float):
            said += f" in {event['duration_ms'] / 1000:.1f} s"
        lines.append(said[:200])
    return lines


@dataclass
class StartWatch:
    """The launcher's view of a starting stack (see the module docstring)."""

    run_dir: Path
    env: dict[str, str]
    settings: Settings
    groups: list[WorkerGroup]
    say: Say
    redis_wait_s: float = REDIS_WAIT_S
    marks: dict[Path, int] = field(default_factory=dict)
    redis_down_since: float | None = None
    published: bool = False  # the placement record is in Redis
    exits_read: int = 0  # bytes of supervisord's log already read for worker exits
    record_error: str = ""
    progress_read: dict[Path, int] = field(default_factory=dict)  # bytes of each worker log already shown

    def progress(self) -> None:
        """Say what each worker logged since the last call, one line per INFO or WARNING event
        (loading the model, the memory plan, measuring the KV cache, each warm-up step...), so a
        start that takes a minute shows what it is doing; errors are said once it fails."""
        for path in sorted(self.run_dir.glob("worker-*.log")):
            seen = self.progress_read.get(path, 0)
            try:
                with path.open("rb") as f:
                    f.seek(seen)
                    text = f.read()
            except OSError:
                continue
            whole = text[: text.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self.progress_read[path] = seen + len(whole)
            for line in progress_lines(whole.decode(errors="replace")):
                self.say(f"up: {path.stem}: {line}")

    @property
    def expected(self) -> list[str]:
        return placed_workers(self.groups)

    def record(self) -> None:
        """Write the placement record once, then each worker exit logged since the last call (see
        vramguard/cli/placed.py); a Redis error is said once."""
        error = None
        if not self.published:
            error = placed.write(self.settings, placement_record(self.groups), replace=True)
            self.published = error is None
        log = read_since(self.run_dir / "supervisord.log", {self.run_dir / "supervisord.log": self.exits_read})
        self.exits_read += len(log.encode())
        processes = {process for process, _ in placed.EXITED.findall(log)}
        reasons = {p: (logged_errors(read_since(self.run_dir / f"{p}.log", {})) or [""])[-1] for p in processes}
        error = error or placed.write(self.settings, placed.exits_since(log, self.groups, reasons))
        if error and error != self.record_error:
            self.say(f"up: cannot write the placement record for the status page: {error}")
        self.record_error = error or ""

    def check(self) -> tuple[list[str] | None, str]:
        """(programs that cannot start, or None; what is still awaited, '' when every placed worker is ready).
        Raises TimeoutError when Redis has not answered for `redis_wait_s`."""
        beats = worker_beats(self.settings, self.expected)
        if beats is None:
            now = time.monotonic()
            self.redis_down_since = self.redis_down_since or now
            if now - self.redis_down_since > self.redis_wait_s:
                raise TimeoutError(f"Redis at {mask_url_password(self.settings.redis_url)} did not answer in "
                                   f"{self.redis_wait_s:g} s (--redis-wait-s)")
            self.marks = log_marks(self.run_dir)  # exits while Redis is away are not start failures
            return None, (f"Redis at {mask_url_password(self.settings.redis_url)} to answer "
                          f"(waiting up to {self.redis_wait_s:g} s, --redis-wait-s)")
        self.redis_down_since = None
        self.record()
        fatal = [name for name, state in program_states(self.run_dir, self.env).items() if state == "FATAL"]
        failing = fatal or failing_at_start(self.run_dir, self.marks)
        if failing:
            return failing, ""
        not_ready = [w for w in self.expected if beats.get(w) is None or beats[w].state != "ready"]
        return None, ("" if not not_ready else f"workers to be ready: {', '.join(not_ready)}")


def gateway_reasons(port: str) -> str:
    """'' when the gateway's /health/ready answers 200, else its reasons."""
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2.0)
        if response.status_code == 200:
            return ""
        return "; ".join(response.json().get("reasons", [])) or f"HTTP {response.status_code}"
    except (httpx.HTTPError, ValueError):
        return "gateway not answering yet"


def watch_running(proc: subprocess.Popen[bytes], watch: StartWatch) -> int:
    """After ready: keep the status page's record of worker exits until supervisord exits; its exit code."""
    while True:
        try:
            return proc.wait(timeout=CHECK_EVERY * POLL_S)
        except subprocess.TimeoutExpired:
            watch.record()


def wait_ready(proc: subprocess.Popen[bytes], port: str, watch: StartWatch) -> bool:
    """Poll until the gateway and every placed worker are ready (True). False when supervisord
    exits, a program cannot start (its errors are said), Redis stays away past its limit, or
    READY_TIMEOUT_S passes."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last, polls, workers_waiting = "", 0, "placed workers not checked yet"
    while time.monotonic() < deadline and proc.poll() is None:
        if polls % CHECK_EVERY == 0:
            try:
                failing, workers_waiting = watch.check()
            except TimeoutError as exc:
                watch.say(f"up: {exc}")
                return False
            if failing:
                report_failing(failing, watch.run_dir, watch.say)
                return False
        polls += 1
        watch.progress()
        redis_late = workers_waiting.startswith("Redis")
        awaited = workers_waiting if redis_late else (gateway_reasons(port) or workers_waiting)
        if not awaited:
            return True
        if awaited != last:
            watch.say(f"up: waiting for {awaited}" if awaited.startswith(("Redis", "workers"))
                      else f"up: waiting for readiness: {awaited}")
            last = awaited
        time.sleep(POLL_S)
    return False
