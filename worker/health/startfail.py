"""A worker that cannot start says why where the gateways look: before it exits with a start
failure (exit code 3 or 7) it records its exit code and reason in `keys.start_failures(model)`
(a hash, worker_id -> JSON, expiring after START_FAILURE_TTL_S), and the gateway's readiness of
that model names it (gateway/observe/health.py), so a crash-looping plug-in is reported with its error,
not only as "no live worker". Best effort: Redis may be the reason it cannot start."""

from __future__ import annotations

import asyncio
import json
import logging

from vramguard.shared.clock import now_ms
from vramguard.shared.keys import Keys
from vramguard.shared.redis_client import connect
from vramguard.shared.settings import Settings

log = logging.getLogger(__name__)

START_FAILURE_TTL_S = 600  # a record older than the last crash loop's restarts says nothing any more
REASON_CHARS = 500
REPORT_TIMEOUT_S = 3.0


async def report_start_failure(settings: Settings, exit_code: int, reason: str) -> None:
    """Record this worker's failed start (`exit_code`, `reason` cut to REASON_CHARS). Never raises:
    Redis not answering within REPORT_TIMEOUT_S is logged and skipped."""
    key = Keys(settings.key_prefix).start_failures(settings.model)
    record = json.dumps({"exit_code": int(exit_code), "reason": reason[:REASON_CHARS], "at_ms": now_ms()})
    client = connect(settings)
    try:
        async with client.pipeline(transaction=True) as pipe:
            pipe.hset(key, settings.consumer_name, record)
            pipe.expire(key, START_FAILURE_TTL_S)
            await asyncio.wait_for(pipe.execute(), REPORT_TIMEOUT_S)
    except Exception as exc:  # best effort: the log line of the failure itself stays
        log.warning("could not record the failed start in Redis", extra={"error": repr(exc)})
    finally:
        await client.aclose()
