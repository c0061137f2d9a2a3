"""PrimaryWatch (shared/failover.py) against real sentinels: a stopped primary's connections are
dropped the moment the sentinels name a new one, and a reader's back-off ends then."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis

from tests.topology import MASTER_NAME, SentinelTopology, wait_for
from vramguard.shared.failover import PrimaryWatch
from vramguard.shared.redis_client import BLOCKING_SLACK_S, close, connect_blocking
from vramguard.shared.settings import Settings

BLOCK_MS = 8000  # the blocking read's socket timeout is this + BLOCKING_SLACK_S: 9.5 s


@pytest.fixture
async def sentinels() -> AsyncIterator[tuple[SentinelTopology, Settings]]:
    topology = SentinelTopology()
    topology.start()
    settings = Settings(redis_url="redis://127.0.0.1:1/0", redis_sentinels=topology.addresses.split(","),
                        redis_sentinel_master=MASTER_NAME, block_ms=BLOCK_MS)
    try:
        yield topology, settings
    finally:
        for proc in topology.procs.values():  # a stopped primary ends at SIGTERM only once continued
            proc.send_signal(signal.SIGCONT)
        topology.stop()


def _stop_primary(topology: SentinelTopology) -> int:
    """SIGSTOP the primary: it keeps its connections and its address and answers nothing; the
    sentinels find it down (down-after-milliseconds 1000) and promote a replica. Returns its port."""
    stopped = topology.primary
    topology.procs[stopped].send_signal(signal.SIGSTOP)
    return stopped


async def test_a_read_parked_on_a_stopped_primary_moves_to_the_promoted_replica(sentinels) -> None:
    """A blocking XREAD parked on the primary when it is stopped gets its entry from the promoted
    replica once the sentinels name it (about 3 s after the SIGSTOP), before its socket timeout
    (9.5 s): without the watch it waited that out on the stopped primary, then failed."""
    topology, settings = sentinels
    blocking = connect_blocking(settings)
    watch = PrimaryWatch(settings)
    watch.start([blocking])
    try:
        await blocking.ping()  # the read's connection is open to the primary
        await asyncio.sleep(0.5)  # the watch has read the primary's address
        read = asyncio.create_task(blocking.xread({"watched": "$"}, block=BLOCK_MS))
        await asyncio.sleep(0.2)  # parked on the primary
        started = time.monotonic()
        stopped = _stop_primary(topology)
        await asyncio.to_thread(wait_for, lambda: topology.current_primary() != stopped, 15, "a replica promoted")
        promoted = topology.current_primary()
        await asyncio.sleep(1.0)  # the watch polls every 0.25 s; the re-sent read parks on the new primary
        redis.Redis(port=promoted).xadd("watched", {"n": "1"})
        reply = await asyncio.wait_for(read, BLOCK_MS / 1000 + BLOCKING_SLACK_S)
        elapsed = time.monotonic() - started
        assert reply and reply[0][1][0][1] == {b"n": b"1"}, reply
        assert elapsed < BLOCK_MS / 1000, elapsed
        assert watch.switches == 1
    finally:
        await watch.stop()
        await close(blocking)


async def test_a_back_off_ends_when_the_sentinels_name_a_new_primary(sentinels) -> None:
    """`pause(30)` under way when the primary is stopped returns once the sentinels promote a
    replica (within 8 s here: about 3 s measured), not after 30 s."""
    topology, settings = sentinels
    blocking = connect_blocking(settings)
    watch = PrimaryWatch(settings)
    watch.start([blocking])
    try:
        await asyncio.sleep(0.5)
        pause = asyncio.create_task(watch.pause(30))
        started = time.monotonic()
        _stop_primary(topology)
        await asyncio.wait_for(pause, 15)
        assert time.monotonic() - started < 8
        assert watch.switches == 1
    finally:
        await watch.stop()
        await close(blocking)
