"""`python -m vramguard.worker.alive`: the worker's liveness check for an exec probe (deploy/k8s/).

Workers have no HTTP port, so the probe reads the worker's own heartbeat hash
(`keys.heartbeat(settings.consumer_name)`, written by worker/heartbeat.py) with the same
VRAMGUARD_* settings as the worker. Exit 0: the heartbeat is younger than heartbeat_ttl_ms, or
Redis cannot be asked (restarting a worker does not bring Redis back). Exit 1: no heartbeat, or
a stale one: the worker is hung or still warming up (a startupProbe covers the warmup).
Never imports torch: it runs every few seconds beside the worker.
"""

from __future__ import annotations

import asyncio
import sys

from redis.exceptions import RedisError

from vramguard.shared.clock import now_ms, sync_to_redis
from vramguard.shared.keys import Keys
from vramguard.shared.redis_client import connect
from vramguard.shared.settings import Settings, SettingsError


async def check(settings: Settings) -> tuple[bool, str]:
    """(alive, why) for the worker named settings.consumer_name. Never raises for Redis errors."""
    redis = connect(settings)
    try:
        await sync_to_redis(redis)  # beat_ms is on Redis' clock (shared/clock.py); this host's may differ
        beat = await redis.hget(Keys(settings.key_prefix).heartbeat(settings.consumer_name), "beat_ms")
    except RedisError as exc:
        return True, f"Redis unreachable, not judging the worker: {exc}"
    finally:
        await redis.aclose()
    if beat is None:
        return False, f"no heartbeat for worker {settings.consumer_name!r} (hung, or still warming up)"
    age_ms = now_ms() - int(float(beat))
    if age_ms > settings.heartbeat_ttl_ms:
        return False, f"heartbeat {age_ms} ms old (heartbeat_ttl_ms {settings.heartbeat_ttl_ms})"
    return True, f"heartbeat {age_ms} ms old"


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"vramguard.worker.alive: {exc}", file=sys.stderr)
        return 2
    if settings.worker_name is None:
        print("vramguard.worker.alive: VRAMGUARD_WORKER_NAME must be set (the probe runs in another process)",
              file=sys.stderr)
        return 2
    alive, why = asyncio.run(check(settings))
    print(why)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
