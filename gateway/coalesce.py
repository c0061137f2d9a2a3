"""Redis scripts of concurrent requests in one round trip: every script call made during one
pass of the event loop goes out in a single pipeline (EVALSHA each, in call order), so at
concurrency 64 the gateway pays one write and one read for a burst of admissions instead of two
per request. Nothing waits to fill a batch: a call alone is sent on the next loop pass."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT


@dataclass(frozen=True)
class ScriptCall:
    script: AsyncScript
    keys: list[str]
    args: list[EncodableT]


async def run_scripts(redis: aioredis.Redis, calls: list[ScriptCall]) -> list[object]:
    """Run `calls` in order in one pipelined round trip (not a transaction, so under Cluster their
    keys may lie in different slots). A script Redis does not know (NOSCRIPT: it restarted or was
    flushed) is loaded and that call alone sent again, so no script runs twice. Returns each
    call's result or its exception; raises RedisError when the round trip itself fails."""
    results: list[object] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        async with redis.pipeline(transaction=False) as pipe:
            for i in todo:
                pipe.evalsha(calls[i].script.sha, len(calls[i].keys), *calls[i].keys, *calls[i].args)
            answers = await pipe.execute(raise_on_error=False)
        for i, answer in zip(todo, answers, strict=True):
            results[i] = answer
        todo = [i for i in todo if isinstance(results[i], NoScriptError)]
        if not todo or attempt == 1:
            break
        for script in {calls[i].script.sha: calls[i].script for i in todo}.values():
            await redis.script_load(script.script)
    return results


class ScriptBatcher:
    """Collects script calls and sends each loop pass's calls as one `run_scripts` round trip.

    `call` returns a future of the call's result (an exception object when that script failed,
    as run_scripts returns it); when the round trip itself fails, every future of the batch gets
    that RedisError. The round trip runs as its own task, never cancelled by a caller (a cancelled
    redis-py command can poison its connection).
    """

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._pending: list[tuple[ScriptCall, asyncio.Future[object]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def call(self, script: AsyncScript, keys: list[str], args: list[EncodableT]) -> asyncio.Future[object]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((ScriptCall(script, keys, args), future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[ScriptCall, asyncio.Future[object]]]) -> None:
        try:
            results = await run_scripts(self._redis, [call for call, _f in batch])
        except Exception as exc:  # the round trip failed: every caller of the batch sees why
            for _call, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_call, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
