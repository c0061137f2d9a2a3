"""The scenario scripts/compose_check.sh runs against `docker compose --profile cpu up` (run it in the
network namespace of the dockerd it names in DOCKER_HOST; the published port is there).

1. `up -d`, then /health/ready answers 200; a minilm request gets 200 and 384 floats per input.
2. The worker container's init process is SIGKILLed from the host (`docker kill` is a manual stop,
   after which Docker applies no restart policy); once it is gone a request is sent while no worker
   runs. Result: Docker restarts the container (restart count + 1), the request is answered 200 by
   the new worker (its start time is after the request was sent), and a further request is served.
3. `down`. Result: no container, no project network remains.
Exit status 0 when every step held, 1 otherwise (the failing step is named on stderr).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

DOCKER = os.environ.get("DOCKER", "docker")
WORKER = "vramguard-worker-cpu"
READY_TIMEOUT_S = 300.0  # first start: torch import and minilm load on a busy 2-core machine
# A restarted worker container starts supervisor, imports torch and measures its memory plan again
# (62 s seen on a loaded 2-core machine): the request sent meanwhile gets a deadline past that.
BACK_TIMEOUT_S = 300.0
TEXTS = ["a sentence", "another one"]


class CheckFailed(Exception):
    """A step of the scenario did not hold; the message says which and what was seen."""


def log(message: str) -> None:
    print(f"compose_scenario: {message}", file=sys.stderr, flush=True)


def docker(*args: str, timeout_s: float = 300.0) -> str:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def inspect(container: str) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(docker("inspect", container))[0]
    return state


def ready(client: httpx.Client) -> bool:
    try:
        return client.get("/health/ready").status_code == 200
    except httpx.TransportError:
        return False


def infer(client: httpx.Client) -> None:
    """One real minilm request: 200 and one 384-float embedding per input, else CheckFailed."""
    reply = client.post("/v1/models/minilm/infer", json={"inputs": TEXTS}, timeout=BACK_TIMEOUT_S + 10,
                        headers={"X-Request-Timeout-Ms": str(int(BACK_TIMEOUT_S * 1000))})
    if reply.status_code != 200:
        raise CheckFailed(f"infer answered {reply.status_code}: {reply.text[:500]}")
    outputs = reply.json()["outputs"]
    if len(outputs) != len(TEXTS) or any(len(row) != 384 for row in outputs):
        raise CheckFailed(f"infer answered {len(outputs)} rows of {[len(r) for r in outputs]} floats")


def worker_start_times_s(client: httpx.Client) -> list[float]:
    """vramguard_worker_start_time_seconds of every live worker, read from the gateway's /metrics."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    return [s.value for f in families for s in f.samples if s.name == "vramguard_worker_start_time_seconds"]


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def kill_worker_and_request(client: httpx.Client) -> None:
    """Step 2: SIGKILL the worker container's init from the host, send a request while no worker
    runs, and see the restarted container answer it and serve again."""
    before = inspect(WORKER)
    pid, restarts = int(before["State"]["Pid"]), int(before["RestartCount"])
    os.kill(pid, signal.SIGKILL)  # init dies: the kernel kills every process of the container with it
    wait_until(lambda: process_gone(pid), 30, f"the worker container's init (pid {pid}) to exit")
    sent_s = time.time()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(infer, client)
        wait_until(lambda: int(inspect(WORKER)["RestartCount"]) > restarts, 60, "Docker to restart the worker")
        pending.result(timeout=BACK_TIMEOUT_S)
    # /metrics shows the heartbeats the gateway last fetched: the new worker appears within a refresh.
    def only_the_new_worker() -> bool:  # the killed worker's heartbeat expires, the new one's arrives
        started = worker_start_times_s(client)
        return bool(started) and min(started) > sent_s

    wait_until(only_the_new_worker, 30, "the restarted worker alone on /metrics")
    started = worker_start_times_s(client)
    if not started or min(started) <= sent_s:
        raise CheckFailed(f"the request sent at {sent_s:.3f} was served by a worker started at {started}")
    log(f"worker restarted ({restarts} -> {inspect(WORKER)['RestartCount']}); the request sent while it was down "
        f"answered {time.time() - sent_s:.1f} s later, by the worker started {min(started) - sent_s:.1f} s after it")
    infer(client)


def check_down(project: str) -> None:
    """Step 3: `down` leaves no container and no network of the project."""
    docker("compose", "-p", project, "--profile", "cpu", "down", "--timeout", "30")
    containers = docker("ps", "-aq").split()
    networks = [n for n in docker("network", "ls", "--format", "{{.Name}}").split() if n.startswith(project)]
    if containers or networks:
        raise CheckFailed(f"after down: containers {containers}, networks {networks}")


def run(project: str, port: int) -> None:
    started_s = time.monotonic()
    docker("compose", "-p", project, "--profile", "cpu", "up", "-d", "--no-build")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        wait_until(lambda: ready(client), READY_TIMEOUT_S, "/health/ready to answer 200")
        log(f"ready {time.monotonic() - started_s:.1f} s after up")
        infer(client)
        log("a minilm request answered 200 with 384 floats per input")
        kill_worker_and_request(client)
    check_down(project)
    log("down: no container and no project network left")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", default="vramguard", help="compose project name")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's published port (VRAMGUARD_PORT)")
    args = parser.parse_args()
    try:
        run(args.project, args.port)
    except (CheckFailed, httpx.HTTPError, subprocess.TimeoutExpired, TimeoutError) as failure:
        log(f"FAILED: {failure}")
        for service in ("worker-cpu", "gateway"):
            tail = subprocess.run([DOCKER, "compose", "-p", args.project, "--profile", "cpu", "logs", "--tail", "30",
                                   service], capture_output=True, text=True, check=False)
            print(tail.stdout[-4000:], tail.stderr[-1000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
