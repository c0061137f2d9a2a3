"""Scenario 9: a Redis Cluster of three primaries.

1. Three `redis-server --cluster-enabled yes` primaries split the 16384 slots so that the
   `{minilm}` and `{synthetic}` hash tags (shared/keys.py) land on different primaries.
2. A gateway and workers run with VRAMGUARD_REDIS_CLUSTER=true and the URL of one node.
3. End to end: both models answer; each model's stream, group and dead-letter stream sit on its
   own primary, and the gateway's reply stream wherever its tag hashes.
4. Worker SIGKILL: under load, a synthetic worker is killed mid-batch and restarted under its name.

Result: every request is answered exactly once with 200 and, by the workers' execution log,
ran at least once, more than once only when the killed process ran it first; the killed
worker's batch is reclaimed within its slot; no command ever spanned two slots (a CROSSSLOT
error would fail them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from tests.chaos.conftest import Supervisor
from tests.chaos.load import Load, check_executions, count_logged, open_loop, record_figures
from tests.helpers import Stack, wait_until
from tests.topology import ClusterTopology
from vramguard.shared.keys import GROUP, Keys, hash_tag

PREFIX = "vgcluster"
SETTINGS: dict[str, object] = {
    "redis_cluster": "true", "key_prefix": PREFIX, "served_models": "minilm,synthetic", "block_ms": 200,
    "heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1500, "shutdown_grace_s": 5,
    "claim_idle_ms": 1000, "reclaim_interval_ms": 200,
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterTopology]:
    slots = sorted(key_slot(m.encode()) for m in ("minilm", "synthetic"))
    topology = ClusterTopology(splits=(slots[0] // 2, (slots[0] + slots[1]) // 2))  # one model per primary
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()


@pytest.fixture
def cluster_stack(cluster: ClusterTopology, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(cluster.url, tmp_path, **SETTINGS)
    try:
        yield stack
    finally:
        stack.stop()


def owner(cluster: ClusterTopology, key: str) -> int:
    return cluster.port_of_slot(key_slot(hash_tag(key).encode()))


async def test_cluster_end_to_end_two_models_on_two_primaries(cluster, cluster_stack) -> None:
    keys = Keys(PREFIX)
    streams = {m: keys.request_stream(m) for m in ("minilm", "synthetic")}
    assert owner(cluster, streams["minilm"]) != owner(cluster, streams["synthetic"])
    cluster_stack.start_gateway()
    cluster_stack.start_worker(model="minilm")
    cluster_stack.start_worker(model="synthetic")
    await cluster_stack.wait_ready()
    async with httpx.AsyncClient(base_url=cluster_stack.url, timeout=30) as client:

        async def both_live() -> bool:
            models = [(await client.get(f"/v1/models/{m}")).json() for m in streams]
            return all(m["live_workers"] == 1 for m in models)

        await wait_until(both_live, 90)
        text = await client.post("/v1/models/minilm/infer", json={"inputs": ["a sentence", "another"]})
        echo = await client.post("/v1/models/synthetic/infer", json={"inputs": [7, 8]})
    assert text.status_code == 200, text.text
    assert len(text.json()["outputs"]) == 2 and len(text.json()["outputs"][0]) == 384
    assert echo.status_code == 200 and echo.json()["outputs"] == [7, 8], echo.text
    for model, stream in streams.items():
        node = redis.Redis(port=owner(cluster, stream))
        assert node.exists(stream) and node.exists(keys.dead_letter_stream(model)) == 0
        assert [g["name"] for g in node.xinfo_groups(stream)] == [GROUP.encode()]
        assert owner(cluster, keys.dead_letter_stream(model)) == owner(cluster, stream)
        assert owner(cluster, keys.worker_index(model)) == owner(cluster, stream)
    assert "CROSSSLOT" not in cluster_stack.logs(200)


async def test_cluster_worker_sigkill_mid_batch_loses_nothing(cluster, cluster_stack) -> None:
    cluster_stack.settings.update({"served_models": "synthetic", "model": "synthetic",
                                   "models__synthetic__max_batch_size": 8,
                                   "models__synthetic__params": '{"batch_ms": 150}'})
    cluster_stack.start_gateway()
    workers = Supervisor(cluster_stack, 2, fault_injection="true")  # records each execution (worker/batch/execlog.py)
    await cluster_stack.wait_ready()
    await workers.wait_live(cluster_stack.url, 2)
    workers.start_watching()
    started = time.monotonic()
    async with Load(cluster_stack.url, clients=10, timeout_ms=15_000) as load:

        async def killer() -> None:
            await asyncio.sleep(2)
            workers.kill(workers.names[0])

        tally, _ = await asyncio.gather(load.run_for(6), killer())
    await workers.stop_watching()
    tally.report("9 Redis Cluster, worker SIGKILL", time.monotonic() - started, kills=len(workers.exits),
                 reclaimed=count_logged(cluster_stack.log_dir, "entry reclaimed"))
    assert [code for _name, code in workers.exits] == [-9]
    tally.assert_each_answered_with_its_own()
    assert tally.ok == tally.sent, tally.errors
    log = aioredis.Redis(port=owner(cluster, Keys(PREFIX).executions("synthetic")))
    try:
        await check_executions(log, PREFIX, tally, workers.died)  # each ran once, more only after the kill
    finally:
        await log.aclose()
    stream = Keys(PREFIX).request_stream("synthetic")
    node = redis.Redis(port=owner(cluster, stream))
    await wait_until(lambda: node.xlen(stream) == 0 and node.xpending(stream, GROUP)["pending"] == 0, 10)


MIGRATION_RATE_PER_S = 100
MIGRATE_AT_S, MIGRATION_LOAD_S = 3.0, 10.0


async def test_a_slot_migration_under_load_costs_at_most_1_percent(cluster, cluster_stack) -> None:
    """1. A gateway and a synthetic worker on the cluster; 100 requests a second, each sent on
       schedule (an open loop), for 10 s.
    2. At 3 s the slot of the model's hash tag moves to another primary as `redis-cli --cluster
       reshard` moves it (CLUSTER SETSLOT IMPORTING/MIGRATING, MIGRATE of its keys 20 at a time,
       SETSLOT NODE), half a second in each state: keys still on the source, then on the target.
    Result: at most 1 % of the requests sent while the slot migrates get an answer other than 200,
    and none is lost (each answered). It was 97 % (53 of 103 here): the admission named a record key of its own per
    call, always missing, and Redis refuses a script naming a missing key while its slot migrates
    (TRYAGAIN); then redis-py's redirect loop (ASK, MOVED back) failed the health refresh."""
    cluster_stack.settings.update({"served_models": "synthetic", "model": "synthetic"})
    cluster_stack.start_gateway()
    cluster_stack.start_worker(model="synthetic")
    await cluster_stack.wait_ready()
    slot = key_slot(b"synthetic")
    target = next(port for port in cluster.ports if port != cluster.port_of_slot(slot))
    window: list[float] = []
    started = time.monotonic()

    async def migrate() -> None:
        await asyncio.sleep(MIGRATE_AT_S)
        window.append(time.monotonic() - started)
        moved = await asyncio.to_thread(cluster.migrate_slot, slot, target, 0.5)
        window.extend([time.monotonic() - started, moved])

    answers, _ = await asyncio.gather(open_loop(cluster_stack.url, MIGRATION_RATE_PER_S, MIGRATION_LOAD_S,
                                                started, 15_000), migrate())
    began, ended, moved = window
    during = [a for a in answers if began <= a.sent_s <= ended]
    failed = [a for a in during if a.status != 200]
    record_figures(f"9 Redis Cluster slot migration at {MIGRATION_RATE_PER_S}/s: {moved} keys in "
                   f"{ended - began:.1f} s, {len(failed)} of {len(during)} requests during it not 200 "
                   f"{sorted({(a.status, a.code) for a in failed}, key=str)}, "
                   f"{sum(a.status != 200 for a in answers)} of {len(answers)} in all")
    assert all(a.status is not None for a in answers)  # none lost
    assert during and len(failed) <= 0.01 * len(during), sorted({(a.status, a.code) for a in failed}, key=str)
    assert redis.Redis(port=target).exists(Keys(PREFIX).request_stream("synthetic"))
