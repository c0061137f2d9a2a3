"""`PrimaryWatch`: under Sentinel, drop every connection to the old primary the moment the
sentinels name a new one, in-flight commands included.

Why: a primary that is stopped, not dead (SIGSTOP, a paused VM, a host swapping), keeps its
address and its open connections and answers nothing. redis-py's Sentinel pool asks the sentinels
for the primary only when it opens a connection, so a command already sent to the stopped
primary, and every blocking read parked on it, waits out its socket timeout (COMMAND_TIMEOUT_S,
BLOCK + BLOCKING_SLACK_S) after the replica was promoted; measured here, the gateway reached the
new primary 3.2 s after the fault and the workers later still. Closing those connections fails
their commands with a ConnectionError, which the clients' retry policy re-sends on a fresh
connection, and a fresh connection goes to the primary the sentinels name now
(shared/redis_client.py). Every command sent through these clients may run twice (redis_client's
`_retry` says why that is safe), so re-sending one whose first copy reached the old primary is too.

The watch asks the sentinels every WATCH_INTERVAL_S (one SENTINEL MASTERS round trip, the call
redis-py's own discovery makes) and acts only on a change of address: a primary that the
sentinels merely think down is left to the clients' own timeouts, as a replica is not yet serving.
The readers that back off after failed calls (the gateway's reply reader, the workers' loops) do
so through `pause`, which a switch ends: they read from the new primary at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisError

from vramguard.shared.periodic import Periodic
from vramguard.shared.redis_client import sentinel_manager
from vramguard.shared.settings import Settings

log = logging.getLogger(__name__)

# A failover is over a few hundred ms after the promotion's election (down-after-milliseconds
# before it): polling at this pace adds at most this much to it, for 4 sentinel round trips a second.
WATCH_INTERVAL_S = 0.25


class PrimaryWatch:
    """Watches the primary's address for the clients given to `start` (those `connect` and
    `connect_blocking` built) and, when it changes, disconnects each client's pool, connections in
    use included, and ends every `pause` under way. Inert unless settings.redis_sentinels is set.
    Build, start and stop it on the event loop that runs the clients."""

    def __init__(self, settings: Settings) -> None:
        self._master = settings.redis_sentinel_master
        self._sentinel = sentinel_manager(settings) if settings.redis_sentinels else None
        self._pools: list[SentinelConnectionPool] = []
        self._address: tuple[str, int] | None = None
        self._poller = Periodic("primary-watch", self._check, WATCH_INTERVAL_S)
        self._switched = asyncio.Event()  # set at a switch, then replaced by a fresh one
        self.switches = 0  # failovers acted on (tests and logs)

    def start(self, clients: list[aioredis.Redis]) -> None:
        if self._sentinel is None:  # a plain URL, or a Cluster client (which has no pool: it follows MOVED)
            return
        self._pools = [c.connection_pool for c in clients if isinstance(c.connection_pool, SentinelConnectionPool)]
        if self._pools:
            self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                await sentinel.aclose()

    async def pause(self, delay_s: float) -> None:
        """Sleep `delay_s` (a reader's back-off after a failed Redis call), or less: until the
        sentinels name a new primary. A reader backing off through a failover (its calls fail
        while no primary is named, so its back-off grows towards seconds) reads again the moment
        the new primary is known, instead of after the rest of its back-off.

        A cancel always propagates, even one that comes as a switch ends the pause: not
        asyncio.wait_for, which on Python 3.11 returns when its inner wait finished in the same loop
        pass as the cancel, and so swallows it (a reader cancelled at shutdown would read on)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await self._switched.wait()

    async def _check(self) -> None:
        assert self._sentinel is not None
        try:
            address = await self._sentinel.discover_master(self._master)
        except RedisError:  # no sentinel answers, or none names a primary it thinks up: nothing new
            return
        address = (str(address[0]), int(address[1]))
        if self._address is not None and address != self._address:
            self.switches += 1
            log.warning("the sentinels name a new primary; dropping the connections to the old one",
                        extra={"old": f"{self._address[0]}:{self._address[1]}", "new": f"{address[0]}:{address[1]}"})
            for pool in self._pools:
                await pool.disconnect(inuse_connections=True)
            self._switched.set()
            self._switched = asyncio.Event()
        self._address = address
