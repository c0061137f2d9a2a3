"""Serving cost: the CPU time every server process spends per request (psutil's user + system
time of each process and its children, before and after a load point), split by role (gateway,
Redis, workers; the load client's own process reported beside them, never in the total).

CPU time is what a request costs the machine whatever else runs on it, so this figure is far
less sensitive to a busy box than throughput: a server that is starved gets fewer requests
through but spends about the same CPU on each one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import psutil
import redis

from bench.corpus import load_corpus
from bench.loadgen import body_cycle, run_point
from bench.stats import summarize

Roles = Mapping[str, list[int]]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live children; 0 when it has exited."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def cpu_by_role(roles: Roles) -> dict[str, float]:
    """CPU seconds so far of each role's processes, summed per role."""
    return {role: sum(process_cpu_s(pid) for pid in pids) for role, pids in roles.items()}


def redis_calls(url: str) -> dict[str, int]:
    """Calls so far of each command on the Redis at `url` (INFO commandstats: commands run inside
    scripts are counted too, each under its own name), less the INFO call that reads them."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    calls["info"] = calls.get("info", 0) - 1
    return calls


def commands_per_request(before: Mapping[str, int], after: Mapping[str, int], answered: int) -> dict[str, float]:
    """Redis commands per answered request from two redis_calls() readings: "total", then each
    command that ran, most frequent first."""
    deltas = {name: after[name] - before.get(name, 0) for name in after if after[name] > before.get(name, 0)}
    out = {"total": round(sum(deltas.values()) / max(answered, 1), 2)}
    out.update({name: round(n / max(answered, 1), 2) for name, n in sorted(deltas.items(), key=lambda kv: -kv[1])})
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent not idle (all processes, all cores) since boot."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def cost_point(url: str, roles: Roles, *, concurrency: int, duration_s: float, warmup_s: float, label: str,
               progress: bool, redis_url: str | None = None) -> dict[str, object]:
    """One load point against `url` with the CPU of `roles` measured over all of it.

    The CPU delta covers warm-up, window and drain, so it is divided by every request answered
    in that span (warm-up ones included), not by the window's count. Returns the load summary
    plus `cpu_us_per_request` (per role), `server_cpu_us_per_request` (their sum) and
    `client_cpu_us_per_request` (this process: the load generator); with `redis_url`, also
    `redis_commands_per_request` (commands_per_request over the same span).
    """
    bodies = body_cycle(load_corpus(), lambda text: {"inputs": [text]})
    me = psutil.Process()
    calls_before = redis_calls(redis_url) if redis_url else None
    machine_before = machine_busy_s()
    before, client_before, started = cpu_by_role(roles), sum(me.cpu_times()[:2]), time.perf_counter()
    run = asyncio.run(run_point(url, bodies, concurrency=concurrency, duration_s=duration_s, warmup_s=warmup_s,
                                label=label, progress=progress))
    after, client_after, wall_s = cpu_by_role(roles), sum(me.cpu_times()[:2]), time.perf_counter() - started
    machine_s = machine_busy_s() - machine_before
    answered = max(1, run.warmup_requests + len(run.samples))
    commands = {} if calls_before is None or redis_url is None else {
        "redis_commands_per_request": commands_per_request(calls_before, redis_calls(redis_url), answered)}
    per_role = {role: round(1e6 * (after[role] - before[role]) / answered, 1) for role in roles}
    busy_s = sum(after.values()) - sum(before.values()) + client_after - client_before
    return {**summarize(run), "answered": answered, "cpu_us_per_request": per_role,
            "server_cpu_us_per_request": round(sum(per_role.values()), 1),
            "client_cpu_us_per_request": round(1e6 * (client_after - client_before) / answered, 1),
            # Cores that the server and the client kept busy together, against the machine's: near
            # the count, the box itself is the limit and no server-side change can show a gain.
            "cores_busy": round(busy_s / wall_s, 2), "cores": psutil.cpu_count(),
            # Everything on the machine, other users' processes included (a shared box).
            "machine_cores_busy": round(machine_s / wall_s, 2), **commands}
