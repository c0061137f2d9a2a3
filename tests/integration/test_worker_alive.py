"""`python -m vramguard.worker.health.alive`, the worker's exec liveness probe on Kubernetes: alive while its own
heartbeat (its alive file) is fresh, dead when it has none or a stale one, whatever Redis does."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from tests.helpers import ROOT, RedisServer, Stack, load_slack, service_env, wait_until
from vramguard.shared.keys import Keys
from vramguard.worker.health.alive import check


async def test_alive_follows_the_workers_own_heartbeat(start_worker, settings_factory) -> None:
    await start_worker(worker_name="probe-me")
    alive, why = check(settings_factory(worker_name="probe-me"))
    assert alive, why
    alive, why = check(settings_factory(worker_name="never-started"))
    assert not alive and "no heartbeat" in why
    alive, why = check(settings_factory(worker_name="probe-me", redis_url="redis://127.0.0.1:1/0"))
    assert alive, why  # the probe never asks Redis


def test_alive_as_a_command_exits_1_without_a_heartbeat(fast_settings) -> None:
    env = service_env(str(fast_settings["redis_url"]), key_prefix=fast_settings["key_prefix"],
                      worker_name="ghost")
    done = subprocess.run([sys.executable, "-m", "vramguard.worker.health.alive"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no heartbeat for worker 'ghost'" in done.stdout


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stall and fill without touching the session's."""
    server = RedisServer()
    server.start()
    yield server
    server.stop(signal.SIGKILL)


def manifest_probe() -> tuple[list[str], float]:
    """The worker's liveness probe as deploy/k8s/base/worker.yaml ships it: (command, timeoutSeconds)."""
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "worker.yaml").read_text()) if d]
    worker = next(d for d in docs if d["kind"] == "Deployment")
    probe = worker["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    return [sys.executable, *probe["exec"]["command"][1:]], float(probe.get("timeoutSeconds", 1))


def run_probe(env: dict[str, str]) -> tuple[int, str, float]:
    """Run the shipped probe command: (exit code, its line, seconds it took)."""
    command, timeout_s = manifest_probe()
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


@pytest.mark.slow
async def test_the_probe_exits_0_within_4_s_each_time_while_redis_stalls_20_s(
        own_redis: RedisServer, key_prefix: str, tmp_path: Path) -> None:
    """1. A worker process beats every 200 ms on a Redis of its own.
    2. Redis is stopped (SIGSTOP) for 20 s: it accepts connections but never answers.
    3. The liveness probe runs as the manifest ships it, again and again, through the stall and
       once after SIGCONT.
    Result: every run exits 0 within 4 s (times load_slack()) with a verdict on the worker's own
    heartbeat, not "Redis did not answer" (the old probe asked Redis and took up to 8 s)."""
    settings = {"key_prefix": key_prefix, "block_ms": 200, "heartbeat_interval_ms": 200,
                "heartbeat_ttl_ms": 1500, "shutdown_grace_s": 5}
    stack = Stack(own_redis.url, tmp_path, served_models="synthetic", **settings)
    stack.start_worker(model="synthetic", worker_name="probe-me")
    env = service_env(own_redis.url, worker_name="probe-me", **settings)
    client = aioredis.Redis.from_url(own_redis.url)
    assert own_redis.proc is not None
    runs: list[tuple[int, str, float]] = []
    try:
        await wait_until(lambda: client.exists(Keys(key_prefix).heartbeat("probe-me")), 90)
        own_redis.proc.send_signal(signal.SIGSTOP)
        stalled = time.monotonic()
        try:
            while time.monotonic() - stalled < 20:
                runs.append(await asyncio.to_thread(run_probe, env))
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        runs.append(await asyncio.to_thread(run_probe, env))
    finally:
        await client.aclose()
        stack.stop()
    assert len(runs) >= 4 and all(code == 0 and "heartbeat" in line for code, line, _ in runs), runs
    assert max(took_s for _, _, took_s in runs) < 4 * load_slack(), runs


@pytest.mark.slow
async def test_the_probe_passes_while_redis_refuses_heartbeats_and_fails_a_hung_worker(
    own_redis: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    """1. A worker process beats every 200 ms (heartbeat_ttl_ms 1500) on a Redis of its own.
    2. Redis reaches maxmemory under noeviction: it refuses the heartbeat's writes until the
       worker's heartbeat is gone.
    3. Redis takes writes again; then the worker is stopped (SIGSTOP) until its heartbeat is stale.
    Result: in 2 the probe exits 0 (Redis refuses writes: not the worker's fault, and its alive file
    is fresh); in 3 it exits 0 while the worker beats and 1 once the stopped worker's heartbeat is stale."""
    settings = {"key_prefix": key_prefix, "block_ms": 200, "heartbeat_interval_ms": 200,
                "heartbeat_ttl_ms": 1500, "shutdown_grace_s": 5}
    stack = Stack(own_redis.url, tmp_path, served_models="synthetic", **settings)
    worker = stack.start_worker(model="synthetic", worker_name="probe-me")
    env = service_env(own_redis.url, worker_name="probe-me", **settings)
    client = aioredis.Redis.from_url(own_redis.url)
    beat_key = Keys(key_prefix).heartbeat("probe-me")
    try:
        await wait_until(lambda: client.exists(beat_key), 90)
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1")
        await asyncio.sleep(0.5)  # a beat already sent may still land
        stuck = await client.hget(beat_key, "beat_ms")
        await asyncio.sleep(1.5 + 0.5)  # past heartbeat_ttl_ms: stale (its PEXPIRE is still taken)
        assert await client.hget(beat_key, "beat_ms") == stuck
        code, line, _ = run_probe(env)
        assert code == 0 and "heartbeat" in line, line
        await client.config_set("maxmemory", "0")
        await wait_until(lambda: _fresh(client, beat_key, stuck), 30)
        code, line, _ = run_probe(env)
        assert code == 0 and "heartbeat" in line, line
        worker.send_signal(signal.SIGSTOP)
        await asyncio.sleep(1.5 + 0.5)  # past heartbeat_ttl_ms: stale, then expired
        code, line, _ = run_probe(env)
        assert code == 1, line
    finally:
        worker.send_signal(signal.SIGCONT)
        await client.aclose()
        stack.stop()


async def _fresh(client: aioredis.Redis, key: str, stuck: bytes | None) -> bool:
    return await client.hget(key, "beat_ms") not in (None, stuck)
