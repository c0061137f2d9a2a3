"""The shipped Redis Sentinel configs (deploy/redis/sentinel/), loaded by a real redis-server: the
nodes keep vramguard's keys (noeviction) and a primary without a replica in sync refuses writes
(min-replicas-to-write), which the gateway's 503 names."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from tests.helpers import ROOT, free_port
from tests.topology import wait_for
from vramguard.shared.redis_client import NO_REPLICAS_MESSAGE, describe_refusal, find_redis_server

SENTINEL = ROOT / "deploy" / "redis" / "sentinel"


def test_a_lone_primary_from_the_shipped_config_refuses_writes_naming_its_replicas(tmp_path: Path) -> None:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    conf = tmp_path / "redis.conf"
    shutil.copyfile(SENTINEL / "redis.conf", conf)  # a node may rewrite its config: a copy
    port = free_port()
    proc = subprocess.Popen([binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                             "--appendonly", "no", "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, socket_timeout=2)
        wait_for(client.ping, 10, "the node")
        config = client.config_get("*")
        assert config["maxmemory-policy"] == "noeviction" and config["replica-read-only"] == "yes"
        assert int(config["min-replicas-to-write"]) >= 1 and int(config["min-replicas-max-lag"]) > 0
        with pytest.raises(redis.ResponseError) as refused:
            client.set("k", "v")
        assert describe_refusal(refused.value) == NO_REPLICAS_MESSAGE
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_shipped_sentinel_config_monitors_the_name_the_settings_default_to() -> None:
    lines = (SENTINEL / "sentinel.conf").read_text().splitlines()
    monitor = next(line.split() for line in lines if line.startswith("sentinel monitor "))
    assert monitor[2] == "vramguard" and int(monitor[5]) == 2  # VRAMGUARD_REDIS_SENTINEL_MASTER's default, quorum


def test_the_shipped_node_listens_on_the_port_the_shipped_sentinel_monitors() -> None:
    """Both files as a user deploys them: the nodes start from redis.conf, the sentinels look for
    the primary at sentinel.conf's `sentinel monitor` port (a node config rewritten by a test once
    shipped with that test's port, where no sentinel looked)."""
    node = (SENTINEL / "redis.conf").read_text().splitlines()
    ports = [line.split()[1] for line in node if line.startswith("port ")]
    sentinel = (SENTINEL / "sentinel.conf").read_text().splitlines()
    monitor = next(line.split() for line in sentinel if line.startswith("sentinel monitor "))
    assert ports == [monitor[4]] == ["6379"]
