"""Random placements on simulated GPUs, with real worker processes under the shipped supervisor
configuration: whatever the placement and the order in which workers start, die and restart, no
GPU runs out of memory, no worker reserves more than its cap, and no request fails."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, Stack, service_env, wait_until
from tests.memwatch import GpuWatch
from vramguard.cli.placement import Gpu, WorkerGroup
from vramguard.cli.programs import SHIPPED_CONF, write_programs

MIB = 1024 * 1024
PLACEMENTS = int(os.environ.get("TEST_PLACEMENTS", "20"))  # fewer while developing
SIM_BYTES = 1024 * MIB
WATERMARK = 0.8
# The placements are drawn from 1-4 GPUs, 1-5 workers per GPU and 1-3 models, then redrawn while
# they have more than MAX_WORKERS workers in all: every worker process imports torch (seconds of
# CPU), and the test must fit its time budget on 2 busy cores.
MAX_WORKERS = 4
CLIENTS = 100
BURST_S = 1.0  # load between the kills
DEADLINE_MS = 180_000


@dataclass(frozen=True)
class Placement:
    seed: int
    models: dict[str, dict[str, float]]  # name -> synthetic params
    groups: list[WorkerGroup]

    @property
    def workers(self) -> int:
        return sum(g.workers for g in self.groups)

    def describe(self) -> str:
        return ", ".join(f"{g.model}x{g.workers}@gpu{g.gpu.index}:{g.share:.3f}" for g in self.groups if g.gpu)


def draw(seed: int) -> Placement:
    """A random placement: models with random weights and item sizes; GPUs with random workers,
    each of a random model, with random shares that add up to the watermark on each GPU."""
    rng = random.Random(seed)
    while True:
        gpus = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        if sum(gpus) <= MAX_WORKERS:
            break
    names = [f"p{seed}m{i}" for i in range(rng.randint(1, 3))]
    models = {n: {"weights_mib": rng.choice([16, 32, 48]), "fixed_mib": 4, "item_mib": rng.choice([2, 4, 8]),
                  "batch_ms": 2, "item_ms": 0.2} for n in names}
    groups = []
    for index, count in enumerate(gpus):
        picks = Counter(rng.choice(names) for _ in range(count))
        weight = {m: rng.uniform(1, 2) for m in picks}
        unit = WATERMARK / sum(weight[m] * n for m, n in picks.items())
        for model, n in sorted(picks.items()):
            share = int(weight[model] * unit * 1e6) / 1e6  # as make up writes it, rounded down
            groups.append(WorkerGroup(model=model, gpu=Gpu(index, str(index)), workers=n, workers_on_device=count,
                                      share=share))
    return Placement(seed, {m: p for m, p in models.items() if any(g.model == m for g in groups)}, groups)


def models_file(path: Path, models: dict[str, dict[str, float]]) -> Path:
    """A TOML models file (shared/models.py) declaring each model as the synthetic class with its
    params. The deadline outlasts a restart on a loaded machine (tens of seconds): a request that a
    killed worker held waits for its successor to replay it, and must not expire meanwhile."""
    lines = []
    for name, params in models.items():
        inline = ", ".join(f"{key} = {value}" for key, value in params.items())
        lines += [f"[{name}]", 'backend = "vramguard.worker.models.synthetic:SyntheticBackend"',
                  'description = "synthetic model of a random placement"', 'input_kind = "json"',
                  'output = {kind = "json", description = "the input itself"}',
                  f"defaults = {{max_batch_size = 64, max_wait_ms = 2, default_timeout_ms = {DEADLINE_MS}, "
                  f"params = {{{inline}}}}}", ""]
    path.write_text("\n".join(lines))
    return path


class PlacedSupervisor:
    """The workers of a placement under one supervisord running the shipped configuration."""

    def __init__(self, stack: Stack, placement: Placement, run_dir: Path, **settings: object) -> None:
        self.run_dir = run_dir
        self.placement = placement
        write_programs(run_dir, placement.groups)
        env = {**service_env(stack.redis_url, **{**stack.settings, **settings}),
               "VG_RUN_DIR": str(run_dir), "VG_ROOT": str(ROOT), "VG_PYTHON": sys.executable,
               "VG_START_REDIS": "false", "VG_START_GATEWAY": "false", "VG_GATEWAYS": "1",
               "VG_REDIS_SERVER": "redis-server", "VG_REDIS_PORT": "0"}
        env.pop("VRAMGUARD_WORKER_NAME", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(SHIPPED_CONF)],
                                     env=env, cwd=run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def spawns(self) -> dict[str, list[int]]:
        """Process name -> pids of its spawns, in order (supervisord.log)."""
        log = self.run_dir / "supervisord.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        out: dict[str, list[int]] = {}
        for name, pid in re.findall(r"spawned: '([\w.-]+)' with pid (\d+)", text):
            out.setdefault(name, []).append(int(pid))
        return out

    def exits(self) -> list[str]:
        log = self.run_dir / "supervisord.log"
        return re.findall(r"exited: [\w.-]+ \(([^;)]*)", log.read_text(errors="replace")) if log.exists() else []

    def worker_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.run_dir.glob("worker-*.log")))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serving_ooms(logs: str) -> int:
    """OOM events while serving, from the workers' "batch done" log lines (the warmup's own
    batch, run before the plan exists, is not serving)."""
    return sum(int(n) for n in re.findall(r'"message": "batch done".*?"oom_events": (\d+)', logs))


async def live_counts(client: httpx.AsyncClient, models: list[str]) -> dict[str, int]:
    counts = {}
    for model in models:
        try:
            counts[model] = int((await client.get(f"/v1/models/{model}")).json()["live_workers"])
        except (httpx.HTTPError, KeyError, ValueError):
            counts[model] = 0
    return counts


@dataclass
class Requests:
    sent: int = 0
    failed: int = 0
    failures: Counter[str] | None = None


async def load_until(url: str, models: list[str], done: asyncio.Event, tally: Requests) -> None:
    """CLIENTS closed loops, each sending to the placement's models in turn, until `done`."""
    tally.failures = Counter()
    values = itertools.count()
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_MS / 1000 + 10, limits=limits) as client:

        async def loop(n: int) -> None:
            for model in itertools.cycle(models[n % len(models):] + models[:n % len(models)]):
                if done.is_set():
                    return
                value = next(values)
                tally.sent += 1
                try:
                    response = await client.post(f"/v1/models/{model}/infer", json={"inputs": [value]})
                    ok = response.status_code == 200 and response.json()["outputs"] == [value]
                    reason = f"{response.status_code} {response.text[:120]}"
                except httpx.HTTPError as exc:
                    ok, reason = False, repr(exc)
                if not ok:
                    tally.failed += 1
                    tally.failures[reason] += 1  # type: ignore[index]

        await asyncio.gather(*(loop(n) for n in range(CLIENTS)))


async def kill_each_until_back(supervisor: PlacedSupervisor, rng: random.Random,
                               all_live: Callable[[], Awaitable[bool]], gap_s: tuple[float, float],
                               timeout_s: float, interval_s: float) -> int:
    """SIGKILL every worker process once, in `rng`'s order, a random gap (`gap_s`, seconds) apart,
    then wait until supervisord restarted each and `all_live` holds again. Returns the kills."""
    processes = sorted(supervisor.spawns())
    rng.shuffle(processes)
    for name in processes:
        await asyncio.sleep(rng.uniform(*gap_s))
        os.kill(supervisor.spawns()[name][-1], signal.SIGKILL)

    async def all_back() -> bool:
        spawns = supervisor.spawns()
        return all(len(spawns[p]) >= 2 for p in processes) and await all_live()

    await wait_until(all_back, timeout_s, interval_s=interval_s)
    return len(processes)


async def run_placement(stack: Stack, placement: Placement, root: Path, models_path: Path) -> dict[str, object]:
    """Start every worker of `placement`, then SIGKILL each in random order under load (supervisord
    restarts it), until all are live again. Returns the figures."""
    rng = random.Random(placement.seed)
    run_dir = root / f"placement-{placement.seed}"
    ledger = run_dir / "ledger"
    models = sorted(placement.models)
    gpus = sorted({g.gpu.index for g in placement.groups if g.gpu is not None})
    expected = Counter({m: sum(g.workers for g in placement.groups if g.model == m) for m in models})
    supervisor = PlacedSupervisor(stack, placement, run_dir, device="sim", sim_memory_bytes=SIM_BYTES,
                                  device_ledger_dir=ledger, models_file=models_path, watermark=WATERMARK,
                                  claim_idle_ms=1500, reclaim_interval_ms=300)
    watches = [GpuWatch(ledger, f"sim-{i}") for i in gpus]
    tally, done = Requests(), asyncio.Event()
    try:
        for watch in watches:
            watch.__enter__()
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            async def all_live() -> bool:
                return Counter(await live_counts(client, models)) == expected and len(supervisor.spawns()) == \
                    placement.workers

            await wait_until(all_live, 120, interval_s=0.2)
            traffic = asyncio.create_task(load_until(stack.url, models, done, tally))
            kills = await kill_each_until_back(supervisor, rng, all_live, (0, BURST_S), 120, interval_s=0.2)
            await asyncio.sleep(BURST_S)
            done.set()
            await traffic
    finally:
        done.set()
        supervisor.stop()
        for watch in watches:
            watch.__exit__()
    logs = supervisor.worker_logs()
    return {
        "seed": placement.seed, "placement": placement.describe(), "workers": placement.workers,
        "sent": tally.sent, "failed": tally.failed, "failures": dict(tally.failures or {}),
        "oom_events": serving_ooms(logs), "kills": kills,
        "max_used_mib": max(w.max_used_bytes for w in watches) / MIB,
        "max_over_cap_bytes": max(w.max_over_cap_bytes for w in watches),
        "closest_to_cap": max((w.worst_reserved_vs_cap for w in watches), key=lambda rc: rc[0] - rc[1]),
        "samples": sum(w.samples for w in watches),
        "exits": Counter(supervisor.exits()),
    }


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_random_placements_never_run_a_gpu_out_of_memory(stack: Stack, tmp_path: Path) -> None:
    """For each of PLACEMENTS seeded random placements (20 unless TEST_PLACEMENTS says;
    1-4 simulated GPUs of 1 GiB, 1-5 workers per GPU, 1-3 synthetic models with random weights,
    item sizes and shares):
    1. every worker starts under one supervisord (the shipped configuration);
    2. under 100 concurrent clients, every worker is SIGKILLed in random order, a random moment
       apart; supervisord restarts each; the load runs until all are live again.
    3. A watcher reads each simulated GPU's ledger (per-process used memory, as NVML shows it).
    Result, in every placement: 0 OOM events, 0 failed requests, on each GPU the sum of reserved
    + context + modules over its workers <= its total at every sample, and every worker's
    reserved <= its cap."""
    seeds = os.environ.get("TEST_PLACEMENT_SEEDS")
    placements = [draw(int(seed)) for seed in seeds.split(",")] if seeds else [draw(seed) for seed in range(PLACEMENTS)]
    models_path = models_file(tmp_path / "models.toml", {m: p for pl in placements for m, p in pl.models.items()})
    stack.start_gateway(served_models=",".join(m for pl in placements for m in sorted(pl.models)),
                        models_file=models_path, worker_return_grace_s=600)
    figures = []
    started = time.monotonic()
    for placement in placements:
        figures.append(await run_placement(stack, placement, tmp_path, models_path))
        print(f"[placements] {figures[-1]}")
    total = {k: sum(int(f[k]) for f in figures) for k in ("sent", "failed", "oom_events", "kills", "samples")}
    print(f"[placements] {len(placements)} placements in {time.monotonic() - started:.0f} s: {total}; "
          f"max device used {max(f['max_used_mib'] for f in figures):.1f} MiB of {SIM_BYTES // MIB}; "
          f"closest reserved vs cap {max((f['closest_to_cap'] for f in figures), key=lambda rc: rc[0] - rc[1])}")
    for f in figures:
        assert f["failed"] == 0 and f["oom_events"] == 0, f
        assert f["max_used_mib"] * MIB <= SIM_BYTES and int(f["max_over_cap_bytes"]) <= 0, f  # type: ignore[arg-type]
        assert int(f["sent"]) > 0 and int(f["samples"]) > 0, f  # type: ignore[arg-type]
