"""`python -m vramguard.worker.health.alive`: the worker's liveness check for an exec probe (deploy/k8s/).

Workers have no HTTP port, so the probe reads the worker's own heartbeat hash
(`keys.heartbeat(settings.consumer_name)`, written by worker/health/heartbeat.py) with the same
VRAMGUARD_* settings as the worker. Exit 0: the heartbeat is younger than heartbeat_ttl_ms, or
Redis is the trouble: it cannot be asked within the probe's bound, or it refuses writes
(maxmemory reached, a replica, a failed save), which would stop any worker's heartbeat; a restart
fixes none of that, and Kubernetes would restart every worker at once. Exit 1: no heartbeat, or a
stale one, while Redis takes writes: the worker is hung or still warming up (a startupProbe
covers the warmup). The whole check is bounded by `--timeout-s` and sends each command once (no
retries), so it answers before the probe's timeoutSeconds whatever Redis does.
Never imports torch: it runs every few seconds beside the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from vramguard.shared.clock import now_ms, sync_to_redis
from vramguard.shared.keys import Keys
from vramguard.shared.redis_client import connect
from vramguard.shared.settings import Settings, SettingsError

# The bound on the Redis part of the check. The probe's timeoutSeconds (deploy/k8s/base/worker.yaml,
# 8 s) leaves room above it for starting the interpreter (2 s measured on a loaded 2-core machine).
PROBE_TIMEOUT_S = 2.0
WRITE_TEST_TTL_MS = 1000


async def check(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(alive, why) for the worker named settings.consumer_name, within `timeout_s` seconds.
    Never raises for Redis errors: they are Redis' trouble, not the worker's (alive)."""
    redis = connect(settings, retries=0)
    try:
        async with asyncio.timeout(timeout_s):
            return await _judge(redis, settings)
    except TimeoutError:
        return True, f"Redis did not answer within {timeout_s} s; not judging the worker"
    except RedisError as exc:
        return True, f"Redis unreachable, not judging the worker: {exc}"
    finally:
        await _close(redis)


async def _judge(redis: aioredis.Redis, settings: Settings) -> tuple[bool, str]:
    """Raises RedisError when Redis cannot be asked."""
    keys = Keys(settings.key_prefix)
    await sync_to_redis(redis)  # beat_ms is on Redis' clock (shared/clock.py); this host's may differ
    beat = await redis.hget(keys.heartbeat(settings.consumer_name), "beat_ms")
    if beat is None:
        verdict = f"no heartbeat for worker {settings.consumer_name!r} (hung, or still warming up)"
    else:
        age_ms = now_ms() - int(float(beat))
        if age_ms <= settings.heartbeat_ttl_ms:
            return True, f"heartbeat {age_ms} ms old"
        verdict = f"heartbeat {age_ms} ms old (heartbeat_ttl_ms {settings.heartbeat_ttl_ms})"
    refusal = await _write_refused(redis, keys.liveness_probe(settings.consumer_name))
    if refusal is not None:
        return True, f"{verdict}, but Redis refuses writes (so would any heartbeat); not judging the worker: {refusal}"
    return False, verdict


async def _write_refused(redis: aioredis.Redis, key: str) -> str | None:
    """Why Redis refuses a small write with a TTL (the heartbeat's kind of command), or None when it
    takes it. OOM (maxmemory under noeviction), READONLY (a replica) and MISCONF (a failed save)
    are all error replies (ResponseError and its subclasses in redis-py)."""
    try:
        await redis.set(key, b"1", px=WRITE_TEST_TTL_MS)
    except ResponseError as exc:
        return str(exc)
    return None


async def _close(redis: aioredis.Redis) -> None:
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await redis.aclose()
    except (TimeoutError, RedisError, OSError):
        pass  # the process exits right after: the socket goes with it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vramguard.worker.health.alive",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=PROBE_TIMEOUT_S,
                        help=f"bound on the check's Redis part, seconds (default {PROBE_TIMEOUT_S}); keep it "
                             "about 2 s below the probe's timeoutSeconds")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"vramguard.worker.health.alive: {exc}", file=sys.stderr)
        return 2
    if settings.worker_name is None:
        print("vramguard.worker.health.alive: VRAMGUARD_WORKER_NAME must be set (the probe runs in another process)",
              file=sys.stderr)
        return 2
    alive, why = asyncio.run(check(settings, args.timeout_s))
    print(why)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
