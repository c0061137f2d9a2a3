"""Redis scripts of concurrent requests in one round trip: the script calls made while the
previous round trip is under way go out together in a single pipeline (EVALSHA each, in call
order), so at concurrency 64 the gateway pays one write and one read for a burst of admissions
instead of two per request. This is a database's group commit: normally one round trip is in
flight, and what arrives meanwhile waits for it, so the busier the gateway, the larger each
round trip. Nothing waits to fill a batch: a call made while none is in flight is sent on the
next loop pass. A round trip that stalls (a connection timing out, retries through a failover)
holds the others back for STALL_S only: then the calls waiting behind it go on their own round
trip, up to MAX_IN_FLIGHT at once, so one stuck connection does not become a stuck gateway.

Calls of a script written for many items (`ScriptBatcher.call_grouped`) go further: the round
trip's calls that share the script and its leading keys and args become ONE script call carrying
every item, so Redis runs one EVALSHA (and whatever the script reads once) for the lot. An item
whose caller stopped waiting (its deadline passed, its client left) before the call is sent is
left out of it, and a plain call whose caller stopped waiting is not sent: after an outage, the
backlog of requests already answered 504 is not enqueued for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ClusterError, NoScriptError, ReadOnlyError, ResponseError
from redis.typing import EncodableT

from vramguard.shared.redis_client import RETRIES

# The most items, and bytes of item args, one grouped call carries: they bound how long one
# script holds Redis (a script blocks every other client while it runs) and how large one command
# is; 256 bodies of up to max_body_bytes each would be gigabytes, past Redis' query buffer limit.
# A single item larger than MAX_GROUP_BYTES goes alone.
MAX_GROUP_ITEMS = 256
MAX_GROUP_BYTES = 1024 * 1024

# Group commit's limits. Under load at concurrency 64 an admission round trip takes a few ms on
# one host (14 calls a round trip at 4,400 requests/s, bench/ANALYSIS.md), so one that is still out
# after STALL_S is stuck, not slow. MAX_IN_FLIGHT bounds the round trips (each a pooled connection)
# that stuck ones can pile up before new calls wait again.
STALL_S = 0.010
MAX_IN_FLIGHT = 8


@dataclass(frozen=True)
class ScriptCall:
    script: AsyncScript
    keys: list[str]
    args: list[EncodableT]


async def run_scripts(redis: aioredis.Redis, calls: list[ScriptCall]) -> list[object]:
    """Run `calls` in order in one pipelined round trip (not a transaction, so under Cluster their
    keys may lie in different slots). Returns each call's result or its exception; raises
    RedisError when the round trip itself fails (after the client's own retries).

    Calls that did nothing and may succeed later are sent again, alone: NOSCRIPT (Redis restarted
    or was flushed: the script is loaded first) and READONLY (the primary was demoted under a
    Sentinel failover: a pipeline returns the error instead of retrying, so the pool's
    connections are dropped, the next one asks the sentinels for the new primary, and the call
    waits out the promotion with the client's backoff, shared/redis_client.py). No call runs twice.

    Under Redis Cluster (redis-py refuses EVALSHA in a cluster pipeline) and under Sentinel (a
    failover test lost requests with pipelines: single commands are what redis-py's retries
    cover), each call is its own command, all sent at once: one round trip of latency, not of
    syscalls."""
    if isinstance(redis, RedisCluster):
        return list(await asyncio.gather(*(_redirected(c) for c in calls), return_exceptions=True))
    if isinstance(redis.connection_pool, SentinelConnectionPool):
        return list(await asyncio.gather(*(c.script(keys=c.keys, args=c.args) for c in calls),
                                         return_exceptions=True))
    results: list[object] = [None] * len(calls)
    todo = list(range(len(calls)))
    backoff = ExponentialWithJitterBackoff(base=0.05, cap=0.5)
    for attempt in range(RETRIES + 1):
        async with redis.pipeline(transaction=False) as pipe:
            for i in todo:
                pipe.evalsha(calls[i].script.sha, len(calls[i].keys), *calls[i].keys, *calls[i].args)
            answers = await pipe.execute(raise_on_error=False)
        for i, answer in zip(todo, answers, strict=True):
            results[i] = answer
        todo = [i for i in todo if isinstance(results[i], NoScriptError) or _read_only(results[i])]
        if not todo or attempt == RETRIES:
            break
        missing = {calls[i].script.sha: calls[i].script for i in todo if isinstance(results[i], NoScriptError)}
        for script in missing.values():
            await redis.script_load(script.script)
        if any(_read_only(results[i]) for i in todo):
            await redis.connection_pool.disconnect()
            await asyncio.sleep(backoff.compute(attempt + 1))
    return results


# A script call under Cluster whose redirects ran out ("TTL exhausted", a ClusterError) is sent again
# after a jittered backoff. While a slot migrates, redis-py's async cluster client (8.2) sends the
# ASKING of an ASK redirect and the command it allows as two pooled commands: under load another
# command takes the connection with the ASKING, the target answers MOVED back to the source, which
# answers ASK again, 16 times in a few ms. Until the migration ends (SETSLOT NODE) every try may end
# so; a try after it goes straight to the new owner. Every script sent here may run twice (the
# admission's record answers a re-sent call).
CLUSTER_REDIRECT_RETRY = Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=RETRIES,
                               supported_errors=(ClusterError,))


async def _redirected(call: ScriptCall) -> object:
    async def fail(error: Exception) -> None:
        return None

    return await CLUSTER_REDIRECT_RETRY.call_with_retry(lambda: call.script(keys=call.keys, args=call.args), fail)


def _read_only(result: object) -> bool:
    """A write refused by a replica: READONLY, also as Redis 6 wraps it inside a script's error."""
    return isinstance(result, ReadOnlyError) or (isinstance(result, ResponseError) and "-READONLY" in str(result))


class ScriptBatcher:
    """Collects script calls and sends them as `run_scripts` round trips, normally one at a time:
    the calls made while a round trip is in flight are sent together as soon as it ends, or
    after STALL_S of waiting, whichever comes first (see the module docstring).

    `call` returns a future of the call's result (an exception object when that script failed,
    as run_scripts returns it); when the round trip itself fails, every future of the batch gets
    that RedisError. The round trip runs as its own task, never cancelled by a caller (a cancelled
    redis-py command can poison its connection).
    """

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        # Plain calls and groups, in call order, each with the future of its result.
        self._pending: list[tuple[ScriptCall | _Group, asyncio.Future[object]]] = []
        # The idempotent calls of the batch being collected, by (sha, keys, args): see `call`.
        self._shared: dict[tuple[str, tuple[str, ...], tuple[EncodableT, ...]], asyncio.Future[object]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # The grouped calls being collected, by (sha, leading keys, leading args): see `call_grouped`.
        self._groups: dict[tuple[str, tuple[str, ...], tuple[EncodableT, ...]], _Group] = {}
        self._in_flight = 0  # round trips under way: while one is, calls made now wait for it
        self._stall: asyncio.TimerHandle | None = None  # ends the wait of the pending calls
        self.round_trips = 0  # sent so far (tests and logs)

    def call(self, script: AsyncScript, keys: list[str], args: list[EncodableT], *,
             idempotent: bool = False) -> asyncio.Future[object]:
        """Queue one script call for the next round trip; the future of its result.
        `idempotent`: running the call twice in a row does what running it once does (a check
        that creates what is missing), so an identical call already queued for it (same
        script, keys and args) is not sent again: both callers get the first one's future. Its
        place in the order is the first caller's, before anything either caller queues after it."""
        if idempotent:
            key = (script.sha, tuple(keys), tuple(args))
            future = self._shared.get(key)
            if future is None:
                future = self._shared[key] = self._queue(ScriptCall(script, keys, args))
            return future
        return self._queue(ScriptCall(script, keys, args))

    def call_grouped(self, script: AsyncScript, keys: list[str], args: list[EncodableT],
                     item_keys: list[str], item_args: list[EncodableT], *,
                     call_args: Callable[[], list[EncodableT]] | None = None) -> asyncio.Future[object]:
        """Queue one item of a script that takes many: the calls of one round trip with the same script,
        `keys` and `args` are sent as one call with every item's keys and args appended in call
        order (keys + item_keys..., args + item_args...). The script returns a list, one result per
        item; the future gets this item's (or the call's exception object, or the round trip's
        RedisError, as `call`). The group's place in the order is its first item's; a group holds
        at most MAX_GROUP_ITEMS items and MAX_GROUP_BYTES of item args (then the next one starts).
        `call_args`: made once per call and put right after `args` (args + call_args() +
        item_args...): args of the call's own, such as the id of a record that a re-sent call finds."""
        loop = asyncio.get_running_loop()
        key = (script.sha, tuple(keys), tuple(args))
        size = sum(len(a) for a in item_args if isinstance(a, (bytes, str)))
        group = self._groups.get(key)
        if group is None or len(group.items) >= MAX_GROUP_ITEMS or (
                group.items and group.bytes + size > MAX_GROUP_BYTES):
            leading = [*args, *call_args()] if call_args is not None else list(args)
            group = self._groups[key] = _Group(script, list(keys), leading)
            outcome = self._queue(group)
            outcome.add_done_callback(group.resolve)
        future: asyncio.Future[object] = loop.create_future()
        group.items.append((item_keys, item_args, future))
        group.bytes += size
        return future

    def _queue(self, call: ScriptCall | _Group) -> asyncio.Future[object]:
        """Add `call` to the pending calls (arming their send) and return its future."""
        loop = asyncio.get_running_loop()
        if not self._pending:
            if self._in_flight:
                self._stall = loop.call_later(STALL_S, self._stalled)
            else:
                loop.call_soon(self._flush)
        future: asyncio.Future[object] = loop.create_future()
        self._pending.append((call, future))
        return future

    def _stalled(self) -> None:
        """The round trips in flight took STALL_S: the pending calls go on one of their own."""
        self._stall = None
        if self._in_flight < MAX_IN_FLIGHT:
            self._flush()
        elif self._pending:
            self._stall = asyncio.get_running_loop().call_later(STALL_S, self._stalled)

    def _flush(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        pending, self._pending = self._pending, []
        self._shared = {}
        self._groups = {}
        batch: list[tuple[ScriptCall, asyncio.Future[object]]] = []
        for call, future in pending:
            built = call.build() if isinstance(call, _Group) else call
            if built is None or future.done():  # every caller stopped waiting: nothing to send
                future.cancel()
            else:
                batch.append((built, future))
        if not batch:
            return
        self._in_flight += 1
        self.round_trips += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        """A round trip ended (answered, failed or cancelled at shutdown): send what was made meanwhile."""
        self._tasks.discard(task)
        self._in_flight -= 1
        if not task.cancelled():
            if self._pending:
                self._flush()
            return
        pending, self._pending = self._pending, []  # the loop is closing: nothing more is sent
        self._shared, self._groups = {}, {}
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        for _call, future in pending:
            future.cancel()

    async def _send(self, batch: list[tuple[ScriptCall, asyncio.Future[object]]]) -> None:
        try:
            results = await run_scripts(self._redis, [call for call, _f in batch])
        except Exception as exc:  # the round trip failed: every caller of the batch sees why
            for _call, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled (the loop is closing): nobody waits for an answer any more
            for _call, future in batch:
                future.cancel()
            raise
        for (_call, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


class _Group:
    """The items of one grouped script call, each (item keys, item args, future), and the call's
    leading keys and args. `build` makes the call from the items still awaited when it is sent;
    `resolve` hands its list of results back to them."""

    def __init__(self, script: AsyncScript, keys: list[str], args: list[EncodableT]) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.items: list[tuple[list[str], list[EncodableT], asyncio.Future[object]]] = []
        self.bytes = 0  # of the items' str and bytes args
        self.sent: list[asyncio.Future[object]] = []  # the futures of the items the call carries

    def build(self) -> ScriptCall | None:
        """The call carrying every item whose caller still waits, or None when none does."""
        keys, args = list(self.keys), list(self.args)
        for item_keys, item_args, future in self.items:
            if not future.done():
                keys.extend(item_keys)
                args.extend(item_args)
                self.sent.append(future)
        return ScriptCall(self.script, keys, args) if self.sent else None

    def resolve(self, outcome: asyncio.Future[object]) -> None:
        if outcome.cancelled():
            for _keys, _args, future in self.items:
                future.cancel()
            return
        exc = outcome.exception()
        result = outcome.result() if exc is None else None
        for i, future in enumerate(self.sent):
            if future.done():
                continue
            if exc is not None:
                future.set_exception(exc)
            elif isinstance(result, list) and len(result) == len(self.sent):
                future.set_result(result[i])
            else:  # the script's error (an exception object) or an answer not shaped per item
                future.set_result(result if isinstance(result, BaseException) else
                                  ResponseError(f"grouped script answered {result!r} for {len(self.sent)} items"))
