"""Several gateway processes on one host and one port (`make up GATEWAYS=N`): each binds with
SO_REUSEPORT, the kernel spreads connections over them, and each answers through its own reply
stream. Real gateway and worker processes, real HTTP, a real redis-server."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import psutil
import pytest

from tests.helpers import RedisServer, Stack, wait_until
from tests.integration.test_make_up_gpus import launch

CONNECTIONS = 32  # all on one of two gateways by chance: 2 * 2**-32


def established_on(pid: int, port: int) -> int:
    """Connections of process `pid` accepted on local `port` and still open."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def listening(pid: int, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections("tcp"))


async def test_two_gateways_on_one_port_both_serve(stack: Stack) -> None:
    stack.start_gateway(served_models="synthetic", reuse_port=True)
    second = stack.spawn_gateway("gateway-1", served_models="synthetic", reuse_port=True)
    clients = [httpx.AsyncClient(base_url=stack.url, timeout=30, limits=httpx.Limits(max_connections=1))
               for _ in range(CONNECTIONS)]
    try:
        stack.start_worker(model="synthetic")
        await stack.wait_ready()
        assert stack.gateway is not None
        await wait_until(lambda: listening(second.pid, stack.port), 60, interval_s=0.2)

        async def all_ready() -> bool:  # on fresh connections, so both gateways are asked
            async with httpx.AsyncClient(base_url=stack.url, timeout=10) as probe:
                codes = [(await probe.get("/health/ready", headers={"connection": "close"})).status_code
                         for _ in range(8)]
            return set(codes) == {200}

        await wait_until(all_ready, 60, interval_s=0.3)
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
        # 2. The port answers on fresh connections, whichever gateway takes each.
        codes = {httpx.post(f"{url}/v1/models/synthetic/infer", json={"inputs": [i]}, timeout=30).status_code
                 for i in range(16)}
        assert codes == {200}
