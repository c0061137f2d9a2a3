"""Scenario 10: the Redis primary dies under load and Sentinel promotes its replica.

1. A primary, two replicas and three sentinels (quorum 2, down-after-milliseconds 1000) run as
   real `redis-server` processes, the nodes from the shipped deploy/redis/sentinel/redis.conf
   less its min-replicas-to-write (tests/topology.py says why); the gateway and two workers find the primary through the
   sentinels (VRAMGUARD_REDIS_SENTINELS), never by its address.
2. 10 clients send requests with a 4 s deadline for LOAD_S s; at 3 s the primary gets SIGKILL, or
   (second case) a `SENTINEL FAILOVER` demotes it to a replica while it keeps running, so the
   open connections to it answer writes with READONLY.
3. The sentinels promote the replica; gateway and workers reconnect (and rediscover the
   primary) by themselves.

Result: no request hangs past its deadline (each is answered by deadline + 1.5 s); a request
in flight during the failover either succeeds or fails with 503 (Redis unreachable, or no live
worker while heartbeats resume) or 504 (its entry was not yet replicated when the primary died:
asynchronous replication, docs/guides/redis.md "What a failover can lose"); every request sent once the
stack has recovered succeeds (at most 2 % stragglers).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.chaos.load import Load, open_loop, record_figures
from tests.helpers import Stack, load_slack
from tests.topology import MASTER_NAME, SentinelTopology, wait_for

TIMEOUT_MS = 4000
LOAD_S = 20  # the last RECOVERED_S seconds start 13 s after the failover: time to rediscover on a busy machine
KILL_AT_S = 3
RECOVERED_S = 4  # the last seconds of load, when (almost) every request must succeed
RECOVERED_FAILURES = 0.02


@pytest.fixture
def sentinel_stack(tmp_path: Path) -> Iterator[tuple[Stack, SentinelTopology]]:
    topology = SentinelTopology()
    stack = Stack(
        "redis://127.0.0.1:1/0", tmp_path,  # nothing listens there: only the sentinels can lead to Redis
        redis_sentinels=topology.addresses, redis_sentinel_master=MASTER_NAME,
        served_models="synthetic", model="synthetic", block_ms=200, heartbeat_interval_ms=200,
        heartbeat_ttl_ms=1500, shutdown_grace_s=5, claim_idle_ms=1000, reclaim_interval_ms=200,
        models__synthetic__params='{"batch_ms": 20}',
    )
    try:
        topology.start()
        yield stack, topology
    finally:
        stack.stop()
        topology.stop()


async def _serve(stack: Stack) -> None:
    """The gateway and two workers, ready."""
    stack.start_gateway()
    stack.start_worker(worker_name="sentinel-w0")
    stack.start_worker(worker_name="sentinel-w1")
    await stack.wait_ready()


@pytest.mark.parametrize("how", ["sigkill", "demote"])  # the stopped primary: test_stale_primary_...
async def test_primary_lost_under_load_fails_over_without_hanging(sentinel_stack, how: str) -> None:
    stack, topology = sentinel_stack
    await _serve(stack)
    started = time.monotonic()
    async with Load(stack.url, clients=10, timeout_ms=TIMEOUT_MS) as load:

        async def kill_primary() -> None:
            await asyncio.sleep(KILL_AT_S)
            if how == "sigkill":
                topology.kill(topology.primary)
            else:
                redis.Redis(port=topology.sentinels[0]).execute_command("SENTINEL", "FAILOVER", MASTER_NAME)

        tally, _ = await asyncio.gather(load.run_for(LOAD_S), kill_primary())
    wait_for(lambda: topology.current_primary() in (topology.replica, topology.second_replica), 10,
             "a replica promoted")
    tally.report(f"10 Sentinel failover ({how})", time.monotonic() - started)

    late = [r for r in tally.results if r.latency_s > TIMEOUT_MS / 1000 + 1.5]
    assert not late, late[:3]
    assert tally.lost == 0 and tally.foreign == 0
    assert set(tally.errors) <= {"503 unavailable", "504 deadline_exceeded"}, tally.errors
    recovered = [r for r in tally.results if r.sent_s > started + LOAD_S - RECOVERED_S]
    failed = [r for r in recovered if r.status != 200]
    # A known straggler: after a demotion, one connection in a full suite run has rediscovered the
    # primary late (one 503 or 504 among ~300 requests, seen 2 times in 5 runs); more than 2 % fails.
    assert recovered and len(failed) <= RECOVERED_FAILURES * len(recovered), failed[:3]
    assert tally.ok > 0.5 * tally.sent, tally.errors


STALE_TIMEOUT_MS = 10_000
ANSWER_BOUND_S = 2.5
KILL_AFTER_S = 6  # the stopped primary is killed this long after its SIGSTOP (the failover is over by then)
STALE_RATE_PER_S = 20
# Requests sent this long after the sentinels name the new primary are served: the gateway and the
# workers learn of it by polling the sentinels (every 0.25 s, shared/failover.py) and drop the
# connections to the stopped one at once.
FOLLOW_S = 0.5


async def test_stale_primary_stopped_then_killed_answers_within_2_5_s(sentinel_stack) -> None:
    """1. As above, but 20 requests a second each sent on schedule (an open loop: a client stuck
       on the fault does not stop the sending), with a 10 s deadline; at 3 s the primary gets
       SIGSTOP: it keeps its connections and its address, and answers nothing (a paused VM).
    2. The sentinels promote the replica; 6 s later the stopped primary gets SIGKILL.
    Result: every request sent after the SIGSTOP is answered, served or 503, within 2.5 s (times
    load_slack()): none waits out its deadline on the stopped primary (they used to wait 10 s);
    every request sent from FOLLOW_S after the sentinels named the new primary is served (gateway
    and workers dropped their connections to the stopped one, and their readers' back-offs ended:
    a request admitted then waited up to 2 s more for a reader still backing off)."""
    stack, topology = sentinel_stack
    await _serve(stack)
    started = time.monotonic()
    old_primary = topology.primary
    promoted_s: list[float] = []
    stopped_s: list[float] = []

    async def stop_then_kill_primary() -> None:
        await asyncio.sleep(KILL_AT_S)
        topology.procs[old_primary].send_signal(signal.SIGSTOP)
        # When the signal went, not KILL_AT_S: on a loaded host this task wakes late, and a
        # request sent meanwhile was admitted before the fault (it is served after the failover).
        stopped_s.append(time.monotonic() - started)
        while not promoted_s and time.monotonic() - started < KILL_AT_S + KILL_AFTER_S:
            await asyncio.sleep(0.05)
            if await asyncio.to_thread(topology.current_primary) != old_primary:
                promoted_s.append(time.monotonic() - started)
        await asyncio.sleep(max(0.0, started + KILL_AT_S + KILL_AFTER_S - time.monotonic()))
        topology.kill(old_primary)

    answers, _ = await asyncio.gather(open_loop(stack.url, STALE_RATE_PER_S, LOAD_S, started, STALE_TIMEOUT_MS),
                                      stop_then_kill_primary())
    after = [a for a in answers if a.sent_s >= stopped_s[0]]
    slowest = max(a.latency_s for a in after)
    statuses = sorted({(a.status, a.code) for a in after}, key=str)
    assert promoted_s, "the sentinels never named a new primary"
    followed = [a for a in answers if a.sent_s >= promoted_s[0] + FOLLOW_S]
    slowest_few = sorted(((round(a.latency_s, 2), round(a.sent_s, 2), a.status) for a in after), reverse=True)[:4]
    record_figures(f"10 Sentinel stale primary (SIGSTOP, SIGKILL {KILL_AFTER_S} s later) at {STALE_RATE_PER_S}/s: "
                   f"{len(after)} requests after the fault, {sum(a.status == 503 for a in after)} 503, slowest "
                   f"{slowest:.2f} s, new primary named {promoted_s[0] - stopped_s[0]:.1f} s after the SIGSTOP, "
                   f"slowest of those sent {FOLLOW_S} s after that {max(a.latency_s for a in followed):.2f} s, "
                   f"statuses {statuses}; slowest (latency s, sent s, status): "
                   f"{slowest_few}")
    assert all(a.status in (200, 503) for a in after), statuses
    assert slowest < ANSWER_BOUND_S * load_slack(), slowest
    assert all(a.status == 200 for a in followed), sorted({(a.status, a.code) for a in followed}, key=str)
    recovered = [a for a in answers if a.sent_s > LOAD_S - RECOVERED_S]
    failed = [a for a in recovered if a.status != 200]
    assert recovered and len(failed) <= RECOVERED_FAILURES * len(recovered), failed[:3]
