"""Several gateway processes on one host and one port (`make up GATEWAYS=N`): each binds with
SO_REUSEPORT, the kernel spreads connections over them, and each answers through its own reply
stream; /metrics from any of them shows the host's totals (prometheus_client's multiprocess
mode). Real gateway and worker processes, real HTTP, a real redis-server."""

from __future__ import annotations

import asyncio
import collections
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import RedisServer, Stack, wait_until
from tests.integration.test_make_up_gpus import launch

CONNECTIONS = 32  # all on one of two gateways by chance: 2 * 2**-32
SCRAPES = 8  # each on a fresh connection, so the kernel picks a gateway for each


def established_on(pid: int, port: int) -> int:
    """Connections of process `pid` accepted on local `port` and still open."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def listening(pid: int, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections("tcp"))


async def all_ready(url: str) -> bool:
    """/health/ready answers 200 on 8 fresh connections, so every gateway on the port is asked."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
        codes = [(await probe.get("/health/ready", headers={"connection": "close"})).status_code for _ in range(8)]
    return set(codes) == {200}


async def scrapes(url: str) -> list[str]:
    """SCRAPES /metrics texts, each on a fresh connection."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        responses = [await client.get("/metrics", headers={"connection": "close"}) for _ in range(SCRAPES)]
    assert {r.status_code for r in responses} == {200}
    return [r.text for r in responses]


def served(text: str) -> tuple[float, float, dict[str, float], float]:
    """(requests_total ok, request_duration_seconds_count ok, in-flight by label set, live_workers)
    of synthetic in one scrape, after checking that no family is rendered twice."""
    types = collections.Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    assert [name for name, n in types.items() if n > 1] == [], "a family rendered twice"
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    ok = {"model": "synthetic", "outcome": "ok"}
    total = [s.value for s in samples if s.name == "vramguard_requests_total" and s.labels == ok]
    count = [s.value for s in samples if s.name == "vramguard_request_duration_seconds_count" and s.labels == ok]
    live = [s.value for s in samples if s.name == "vramguard_live_workers" and s.labels == {"model": "synthetic"}]
    assert len(total) == len(count) == len(live) == 1, (total, count, live)
    in_flight = {str(sorted(s.labels.items())): s.value for s in samples if s.name == "vramguard_requests_in_flight"}
    return total[0], count[0], in_flight, live[0]


async def infer_on_own_connections(url: str, n: int, first: int = 0) -> list[httpx.AsyncClient]:
    """`n` requests at once, each on a client of its own (one connection each, left open); returns
    the clients, which the caller closes."""
    clients = [httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1))
               for _ in range(n)]
    replies = await asyncio.gather(*(c.post("/v1/models/synthetic/infer", json={"inputs": [first + i]})
                                     for i, c in enumerate(clients)))
    assert [r.status_code for r in replies] == [200] * n
    return clients


@pytest.mark.slow
async def test_metrics_from_any_gateway_are_the_hosts_totals(stack: Stack, tmp_path: Path) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    shared = {"PROMETHEUS_MULTIPROC_DIR": str(folder)}
    settings = {"served_models": "synthetic", "reuse_port": True}
    stack.start_gateway(shared, **settings)
    second = stack.spawn_gateway("gateway-1", shared, **settings)
    replacement: subprocess.Popen[bytes] | None = None
    try:
        await serving_on_one_port(stack, second)
        # 1. CONNECTIONS requests, served by both gateways (each holds some of the connections).
        clients = await infer_on_own_connections(stack.url, CONNECTIONS)
        held = [established_on(pid, stack.port) for pid in (stack.gateway.pid, second.pid)]
        await asyncio.gather(*(c.aclose() for c in clients))
        assert min(held) > 0, held
        # 2. Every scrape, whichever gateway answers it, counts all of them; nothing in flight,
        #    summed over the gateways (no per-process `pid` label); the cluster series once.
        no_pid = {str([("model", "synthetic")]): 0.0}
        assert [served(text) for text in await scrapes(stack.url)] == [(CONNECTIONS, CONNECTIONS, no_pid, 1)] * SCRAPES
        # 3. The second gateway killed (no clean exit): its counts stay in the sums, its live gauge goes.
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=10)
        assert [served(text) for text in await scrapes(stack.url)] == [(CONNECTIONS, CONNECTIONS, no_pid, 1)] * SCRAPES
        assert not list(folder.glob(f"gauge_livesum_{second.pid}.db"))
        assert (folder / f"counter_{second.pid}.db").exists()
        # 4. Its replacement (what supervisor would start) serves more: the totals go on from there.
        replacement = stack.spawn_gateway("gateway-2", shared, **settings)
        await both_listening(stack, replacement)
        more = 8
        await asyncio.gather(*(c.aclose() for c in await infer_on_own_connections(stack.url, more, CONNECTIONS)))
        total = CONNECTIONS + more
        assert [served(text) for text in await scrapes(stack.url)] == [(total, total, no_pid, 1)] * SCRAPES
    finally:
        for proc in (second, replacement):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.mark.slow
async def test_two_gateways_on_one_port_both_serve(stack: Stack) -> None:
    stack.start_gateway(served_models="synthetic", reuse_port=True)
    second = stack.spawn_gateway("gateway-1", served_models="synthetic", reuse_port=True)
    clients = [httpx.AsyncClient(base_url=stack.url, timeout=30, limits=httpx.Limits(max_connections=1))
               for _ in range(CONNECTIONS)]
    try:
        await serving_on_one_port(stack, second)
        # 1. A request on each of 32 connections: every one answered with its own input echoed.
        replies = await asyncio.gather(*(c.post("/v1/models/synthetic/infer", json={"inputs": [i]})
                                         for i, c in enumerate(clients)))
        assert [r.status_code for r in replies] == [200] * CONNECTIONS
        assert [r.json()["outputs"] for r in replies] == [[i] for i in range(CONNECTIONS)]
        # 2. Both gateway processes hold some of those connections: both served.
        held = [established_on(pid, stack.port) for pid in (stack.gateway.pid, second.pid)]
        assert sum(held) == CONNECTIONS and min(held) > 0, held
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        second.terminate()
        second.wait(timeout=30)


async def test_second_gateway_without_reuse_port_cannot_bind(stack: Stack) -> None:
    stack.start_gateway(served_models="synthetic", reuse_port=True)
    assert stack.gateway is not None
    await wait_until(lambda: listening(stack.gateway.pid, stack.port), 60, interval_s=0.2)
    second = stack.spawn_gateway("gateway-1", served_models="synthetic")  # reuse_port off
    try:
        code = await asyncio.to_thread(second.wait, 60)
    except subprocess.TimeoutExpired:
        second.kill()
        second.wait()
        pytest.fail("a gateway without reuse_port started on a port another gateway holds")
    # The second one exits non-zero; the first still listens.
    assert code != 0
    assert "address already in use" in (stack.log_dir / "gateway-1.log").read_text().lower()
    assert listening(stack.gateway.pid, stack.port)


def gateways_on(port: int) -> list[psutil.Process]:
    """`python -m vramguard.gateway` processes started for `port` (their VRAMGUARD_PORT)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            ours = proc.info["cmdline"][-2:] == ["-m", "vramguard.gateway"]
            if ours and proc.environ().get("VRAMGUARD_PORT") == str(port):
                found.append(proc)
        except (psutil.Error, TypeError):
            continue  # exited, or not ours to read
    return found


@pytest.mark.slow
def test_make_up_gateways_2_starts_two_gateways_on_the_port(redis_server: RedisServer, key_prefix: str) -> None:
    with launch(redis_server.url, key_prefix, "--model", "synthetic", "--gateways", "2") as (url, run_dir):
        port = int(url.rsplit(":", 1)[1])
        # 1. supervisor runs two gateway processes, each with reuse_port, each listening on the port.
        procs = gateways_on(port)
        assert len(procs) == 2
        assert all(p.environ().get("VRAMGUARD_REUSE_PORT") == "true" for p in procs)
        assert all(listening(p.pid, port) for p in procs)
        assert {"gateway-0.log", "gateway-1.log"} <= {p.name for p in run_dir.glob("*.log")}
        # Ready means one worker can serve; the second may still be importing torch on busy cores.
        asyncio.run(wait_until(lambda: both_workers_live(url), timeout_s=90, interval_s=0.5))
        # 2. The port answers on fresh connections, whichever gateway takes each.
        codes = {httpx.post(f"{url}/v1/models/synthetic/infer", json={"inputs": [i]}, timeout=30).status_code
                 for i in range(16)}
        assert codes == {200}
        # 3. Every scrape, whichever gateway answers it, counts all 16 (the gateways' shared metrics
        #    directory, emptied by up.py, is in the run dir); the cluster series once, both workers live.
        no_pid = {str([("model", "synthetic")]): 0.0}
        assert [served(text) for text in asyncio.run(scrapes(url))] == [(16, 16, no_pid, 2)] * SCRAPES
        assert {p.environ().get("PROMETHEUS_MULTIPROC_DIR") for p in procs} == {str(run_dir / "metrics")}


async def both_workers_live(url: str) -> bool:
    """Whether every gateway's scrape (SCRAPES on fresh connections) counts 2 live synthetic workers."""
    def live(text: str) -> list[float]:
        return [s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "vramguard_live_workers" and s.labels == {"model": "synthetic"}]

    return all(live(text) == [2] for text in await scrapes(url))


async def serving_on_one_port(stack: Stack, second: subprocess.Popen[bytes]) -> None:
    """A synthetic worker started, the stack ready, and `second` listening on the stack's port."""
    stack.start_worker(model="synthetic")
    await stack.wait_ready()
    assert stack.gateway is not None
    await both_listening(stack, second)


async def both_listening(stack: Stack, other: subprocess.Popen[bytes]) -> None:
    """`other` listens on the stack's port and every gateway there answers ready."""
    await wait_until(lambda: listening(other.pid, stack.port), 60, interval_s=0.2)
    await wait_until(lambda: all_ready(stack.url), 60, interval_s=0.3)
