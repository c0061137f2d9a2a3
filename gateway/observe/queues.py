"""Queue statistics read at scrape time: entries waiting, pending entries, requests queued and dead
letters per model, for /metrics and the status page (read-only; one pipeline per call), and
`ensure_groups`, which creates each served model's request stream and `workers` group at gateway
start, so an autoscaler reading the group's lag finds it before the first worker exists."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from vramguard.shared.keys import GROUP, Keys


@dataclass(frozen=True, slots=True)
class QueueStats:
    """One model's queue. Answered entries are deleted (XACK + XDEL, worker/batch/publish.py), so the
    request stream's XLEN is waiting + pending; `waiting` = XLEN - pending. `requests`: the
    requests those entries carry (an entry may carry several), as admission counts them against
    `queue_bound` (gateway/admission/dispatch.py ADMISSION, whose rule it applies: XLEN is a floor, and an
    empty stream holds none)."""

    waiting: int
    pending: int
    dead_letters: int
    requests: int


async def read_queue_stats(redis: aioredis.Redis, keys: Keys, models: list[str]) -> dict[str, QueueStats] | None:
    """XLEN, the XPENDING summary, the dead-letter XLEN and the queued-requests counter of each
    model, or None when Redis does not answer (the caller reports redis_up 0 instead of stale
    numbers)."""
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.xlen(keys.request_stream(model))
                pipe.xpending(keys.request_stream(model), GROUP)
                pipe.xlen(keys.dead_letter_stream(model))
                pipe.get(keys.queued_requests(model))
            results = await pipe.execute(raise_on_error=False)
    except RedisError:
        return None
    out = {}
    for i, model in enumerate(models):
        length, summary, dead, counted = results[4 * i : 4 * i + 4]
        if isinstance(length, RedisError) and not isinstance(length, ResponseError):
            return None
        pending = summary.get("pending", 0) if isinstance(summary, dict) else 0  # NOGROUP before any worker
        length = length if isinstance(length, int) else 0
        text = counted.decode() if isinstance(counted, bytes) else counted
        requests = int(text) if isinstance(text, str) and text.lstrip("-").isdigit() else 0
        out[model] = QueueStats(waiting=max(0, length - pending), pending=pending,
                                dead_letters=dead if isinstance(dead, int) else 0,
                                requests=max(requests, length) if length else 0)
    return out


@dataclass(frozen=True, slots=True)
class RedisMemory:
    """Redis' INFO memory fields an operator alerts on: bytes used, maxmemory (0: no limit) and the
    maxmemory-policy (only `noeviction` never deletes queued requests; shared/redis_client.py)."""

    used_bytes: int
    maxmemory_bytes: int
    policy: str


async def read_redis_memory(redis: aioredis.Redis) -> RedisMemory | None:
    """INFO memory (readable where CONFIG is renamed away, as on managed Redis), or None when Redis
    does not answer or leaves the fields out (a Cluster client answers per node: not read there)."""
    try:
        info = await redis.info("memory")
    except RedisError:
        return None
    if not isinstance(info, dict) or "maxmemory_policy" not in info:
        return None
    return RedisMemory(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), str(info["maxmemory_policy"]))


async def ensure_groups(redis: aioredis.Redis, keys: Keys, models: list[str]) -> None:
    """XGROUP CREATE ... MKSTREAM for each model's request stream, from id 0 (as the worker does);
    an existing group (BUSYGROUP) is left alone. Raises RedisError for anything else."""
    for model in models:
        try:
            await redis.xgroup_create(keys.request_stream(model), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
