"""What the status page knows about a `vramguard up` stack beyond heartbeats: every worker process
of its placement, and the last exit of each, with its reason. A worker that cannot start never
writes a heartbeat, so without this record the page would show only the workers that run.

The launcher writes the record (Keys.placement, a hash worker_id -> JSON) when Redis first answers,
and adds each exit it reads in supervisord's log (the exit status or signal, and the last error
the process logged). Best effort: a Redis error is said once and the stack goes on.
"""

from __future__ import annotations

import asyncio
import json
import platform
import re
import time
from typing import cast

from redis.exceptions import RedisError

from vramguard.cli.placement import WorkerGroup
from vramguard.shared.keys import Keys
from vramguard.shared.redis_client import connect
from vramguard.shared.settings import Settings

# supervisord's log: "exited: worker-synthetic-gpu0-1 (exit status 3; not expected)" or
# "exited: worker-synthetic-gpu0-1 (terminated by SIGKILL; not expected)".
EXITED = re.compile(r"exited: (worker-\S+) \((exit status \d+|terminated by \w+); not expected\)")


def worker_id(process: str) -> str:
    """The consumer name of supervisor process `worker-<model>-<device>-<slot>` (vramguard/cli/programs.py
    names both; %(host_node_name)s is platform.node())."""
    return f"{platform.node()}-{process.removeprefix('worker-')}"


def placement_record(groups: list[WorkerGroup]) -> dict[str, str]:
    """worker_id -> JSON {model, program, device} for every worker process of the placement."""
    return {worker_id(f"{g.program}-{slot}"): json.dumps({"model": g.model, "program": g.program,
                                                          "device": g.device_label})
            for g in groups for slot in range(g.workers)}


async def _write(settings: Settings, fields: dict[str, str], replace: bool) -> None:
    redis = connect(settings)
    key = Keys(settings.key_prefix).placement()
    try:
        stale: list[str] = []
        if replace:  # this host's entries of an earlier start; other hosts' stacks keep theirs
            names = cast(list[bytes], await asyncio.wait_for(redis.hkeys(key), timeout=5.0))
            stale = [n.decode() for n in names if n.decode().startswith(f"{platform.node()}-")]
        async with redis.pipeline(transaction=False) as pipe:
            if stale:
                pipe.hdel(key, *stale)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            await asyncio.wait_for(pipe.execute(), timeout=5.0)
    finally:
        await redis.aclose()


def write(settings: Settings, fields: dict[str, str], *, replace: bool = False) -> str | None:
    """HSET `fields` into the placement record (after dropping this host's earlier entries when
    `replace`); the error, or None."""
    if not fields:
        return None
    try:
        asyncio.run(_write(settings, fields, replace))
    except (RedisError, OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def exits_since(log: str, groups: list[WorkerGroup], reason_of: dict[str, str]) -> dict[str, str]:
    """The placement record's entries for the worker exits in `log` (supervisord's), the last one of
    each process: its placement plus {exit, reason, exited_ms}. `reason_of`: process -> its last
    logged error."""
    placed = {wid: json.loads(entry) for wid, entry in placement_record(groups).items()}
    out: dict[str, str] = {}
    for process, how in EXITED.findall(log):
        wid = worker_id(process)
        if wid in placed:
            out[wid] = json.dumps({**placed[wid], "exit": how, "reason": reason_of.get(process, ""),
                                   "exited_ms": int(time.time() * 1000)})
    return out

