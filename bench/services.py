"""The systems under test, each started as real processes on free ports and stopped after use:
vramguard (Redis + gateway + N workers, through tests/helpers.py's RedisServer and Stack),
LitServe (the peer, from its own venv), vLLM's CPU build (its own venv), a naive FastAPI endpoint,
and a trivial endpoint for the load client's own ceiling. Every service exposes an infer URL, a request body shape, its
process ids (for memory) and, for vramguard, the workers' heartbeat counters."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.stats import device_memory_mib, sum_counters
from tests.helpers import ROOT, RedisServer, Stack, free_port
from vramguard.cli.placement import WorkerGroup
from vramguard.cli.programs import worker_environment

READY_TIMEOUT_S = 240.0  # torch import + weights on 2 busy cores
PEER_PYTHON = ROOT / "bench" / ".venv-peer" / "bin" / "python"
# vLLM's CPU build (`make bench-vllm`, bench/vllm-requirements.txt): a venv of its own, since it pins
# its own transformers and fastapi.
VLLM_PYTHON = ROOT / "bench" / ".venv-vllm" / "bin" / "python"
# vLLM compiles the model with torch's inductor at its first start (about 4 min on 2 busy cores; later
# starts load the compiled code from ~/.cache/vllm).
VLLM_READY_TIMEOUT_S = 900.0


def peak_rss_bytes(pids: list[int]) -> int:
    """Sum of the peak resident set (VmHWM, since each process started) over `pids` and all their
    children. Processes that already exited count 0."""
    total = 0
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for proc in {p.pid: p for p in procs}.values():
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll GET `url` until it answers 200. Raises RuntimeError on timeout or if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


@dataclass
class VramguardService:
    """Redis, one gateway and `workers` workers of `model`; `settings` are VRAMGUARD_* values
    (lower-case names, e.g. models__minilm__max_batch_size=32)."""

    name: str
    model: str
    workers: int
    settings: dict[str, object]
    log_dir: Path
    redis: RedisServer | None = None
    stack: Stack | None = None
    kind: str = "vramguard"
    # Workers placed as `make up` places them (CUDA_VISIBLE_DEVICES, share, workers per GPU, from
    # deploy/programs.py); None: `workers` unpinned workers.
    groups: list[WorkerGroup] | None = None
    # Gateway processes on the one port (SO_REUSEPORT, as `make up GATEWAYS=N` runs them).
    gateways: int = 1
    extra_gateways: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        """Start everything and wait for /health/ready. Raises RuntimeError with the logs if not ready."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer()
        self.redis.start()
        base = {"served_models": self.model, "model": self.model, "heartbeat_interval_ms": 250,
                "heartbeat_ttl_ms": 5000, "log_level": "WARNING"}
        shared_port = {"reuse_port": True} if self.gateways > 1 else {}
        self.stack = Stack(self.redis.url, self.log_dir, **{**base, **shared_port, **self.settings})
        self.stack.start_gateway()
        self.extra_gateways = [self.stack.spawn_gateway(f"gateway-{i}") for i in range(1, self.gateways)]
        if self.groups is None:
            for _ in range(self.workers):
                self.stack.start_worker()
        for group in self.groups or []:
            for slot in range(group.workers):
                env = {k: v.replace("%(host_node_name)s", self.name).replace("%(process_num)d", str(slot))
                       for k, v in worker_environment(group).items()}
                self.stack.start_worker(environ=env)
        try:
            wait_http_ok(f"{self.stack.url}/health/ready", READY_TIMEOUT_S, self.stack.gateway)
            self._wait_all_workers()
        except RuntimeError as exc:
            logs = self.stack.logs()
            self.stop()  # nothing of a failed start is left running (callers stop only what started)
            raise RuntimeError(f"{self.name}: {exc}\n{logs}") from None

    def _wait_all_workers(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self.heartbeats()) < self.workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.heartbeats())} of {self.workers} workers came up")
            time.sleep(0.25)

    @property
    def infer_url(self) -> str:
        assert self.stack is not None
        return f"{self.stack.url}/v1/models/{self.model}/infer"

    @property
    def redis_url(self) -> str | None:
        """The stack's Redis, whose INFO commandstats the serving-cost suite reads."""
        return self.redis.url if self.redis is not None else None

    def heartbeats(self) -> dict[str, dict[str, object]]:
        """The live workers' heartbeat hashes as the gateway sees them."""
        assert self.stack is not None
        info = httpx.get(f"{self.stack.url}/v1/models/{self.model}", timeout=5.0).json()
        return dict(info.get("workers", {}))

    def counters(self) -> dict[str, float] | None:
        """The workers' summed heartbeat counters (batches, items, requests, queue_delay_ms_sum)."""
        return sum_counters(self.heartbeats())

    def device_memory(self) -> dict[str, float]:
        """The workers' device-memory heartbeat fields, summed (see stats.device_memory_mib)."""
        return device_memory_mib(self.heartbeats())

    def pids(self) -> list[int]:
        return [pid for pids in self.roles().values() for pid in pids]

    def roles(self) -> dict[str, list[int]]:
        """The server's processes by role, for the serving-cost suite (bench/cost.py)."""
        assert self.stack is not None and self.redis is not None and self.redis.proc is not None
        gateways = [self.stack.gateway, *self.extra_gateways]
        return {"gateway": [p.pid for p in gateways if p is not None], "redis": [self.redis.proc.pid],
                "workers": [p.pid for p in self.stack.workers]}

    def stop(self) -> None:
        for proc in self.extra_gateways:
            proc.terminate()
        for proc in self.extra_gateways:
            proc.wait(timeout=20)
        if self.stack is not None:
            self.stack.stop()
        if self.redis is not None:
            self.redis.stop()


@dataclass
class ProcessService:
    """One server process (`argv`) answering POST `path` with {"inputs": [...]} and 200 on
    `health_path` when ready."""

    name: str
    argv: list[str]
    log_dir: Path
    path: str = "/predict"
    health_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    kind: str = "peer"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    ready_timeout_s: float = READY_TIMEOUT_S

    def start(self) -> None:
        """Start the process and wait for its health path. Raises RuntimeError with its log if not ready."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{self.name}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "BENCH_PORT": str(self.port), **self.env}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_http_ok(f"http://127.0.0.1:{self.port}{self.health_path}", self.ready_timeout_s, self.proc)
        except RuntimeError as exc:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            self.stop()
            raise RuntimeError(f"{self.name}: {exc}\n{tail}") from None

    @property
    def infer_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    @property
    def redis_url(self) -> str | None:
        return None

    def counters(self) -> dict[str, float] | None:
        return None

    def device_memory(self) -> dict[str, float]:
        return {}

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def roles(self) -> dict[str, list[int]]:
        return {"server": self.pids()}

    def stop(self) -> None:
        """SIGTERM the process and its children; SIGKILL what is left after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.proc.terminate()
        for proc in [*children]:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _gone, alive = psutil.wait_procs([psutil.Process(self.proc.pid), *children], timeout=15)
        for proc in alive:
            proc.kill()
        self.proc.wait(timeout=5)


def litserve(log_dir: Path, *, max_batch_size: int, max_wait_ms: float, torch_threads: int) -> ProcessService:
    """LitServe serving minilm (bench/peers/litserve_server.py) from the peer venv."""
    if not PEER_PYTHON.exists():
        raise RuntimeError(f"no peer venv at {PEER_PYTHON.parent.parent}: `make bench` builds it "
                           "(bench/peer-requirements.txt)")
    env = {"BENCH_MAX_BATCH_SIZE": str(max_batch_size), "BENCH_MAX_WAIT_MS": str(max_wait_ms),
           "BENCH_TORCH_THREADS": str(torch_threads)}
    return ProcessService("litserve", [str(PEER_PYTHON), "-m", "bench.peers.litserve_server"], log_dir, env=env)


def litserve_instant(log_dir: Path, *, output_dim: int = 0, max_batch_size: int = 64) -> ProcessService:
    """LitServe with an instant model (bench/peers/litserve_server.py, BENCH_MODEL=instant):
    only its serving path works. `output_dim` 0 echoes each input; N answers a float32 row of N."""
    service = litserve(log_dir, max_batch_size=max_batch_size, max_wait_ms=0.0, torch_threads=1)
    service.name = f"litserve-instant-{output_dim}"
    service.env.update(BENCH_MODEL="instant", BENCH_OUTPUT_DIM=str(output_dim))
    return service


def echo(log_dir: Path, *, output_dim: int = 0) -> ProcessService:
    """The FastAPI echo endpoint (bench/peers/echo_server.py): parses the body and answers at once."""
    return ProcessService(f"echo-{output_dim}", [sys.executable, "-m", "bench.peers.echo_server"], log_dir,
                          env={"BENCH_OUTPUT_DIM": str(output_dim)}, kind="echo")


def naive(log_dir: Path, *, torch_threads: int) -> ProcessService:
    """The naive FastAPI baseline (bench/peers/naive_server.py): calls the model in the request."""
    env = {"BENCH_TORCH_THREADS": str(torch_threads)}
    return ProcessService("naive", [sys.executable, "-m", "bench.peers.naive_server"], log_dir, env=env, kind="naive")


def vllm_cpu(log_dir: Path, *, model_folder: Path, served_name: str, context_window: int, kv_cache_bytes: int,
             threads: int) -> ProcessService:
    """vLLM's CPU build serving the transformers folder `model_folder` as `served_name` through its
    OpenAI server, from its own venv (VLLM_PYTHON). `kv_cache_bytes`: its KV cache
    (--kv-cache-memory-bytes; vLLM rounds it down to whole blocks); `context_window`: --max-model-len;
    `threads`: OpenMP threads, not pinned to a core (VLLM_CPU_OMP_THREADS_BIND=nobind), as the worker
    runs `torch_threads` unpinned. float32 as the worker runs the model.

    Started with `python -m vllm.entrypoints.openai.api_server`: the `vllm` command would look for a
    package named `vllm`, and this build's package is `vllm-cpu`."""
    service = ProcessService("vllm-cpu", [], log_dir, path="/v1/completions", kind="vllm",
                             ready_timeout_s=VLLM_READY_TIMEOUT_S,
                             env={"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                  "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    service.argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
                    "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(service.port),
                    "--max-model-len", str(context_window), "--dtype", "float32",
                    "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    return service


def trivial(log_dir: Path) -> ProcessService:
    """A trivial endpoint (no model): what the load client alone can reach on this machine."""
    return ProcessService("trivial", [sys.executable, "-m", "bench.peers.trivial_server"], log_dir, kind="trivial")
