"""Hop 5: `ReplyListener`, the one task per gateway that reads this gateway's reply stream and
resolves the future of each waiting request. A reply for a request nobody waits for any
more (timed out, or a duplicate of an at-least-once redelivery) is dropped here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

from vramguard.shared.errors import UnavailableError
from vramguard.shared.periodic import Periodic
from vramguard.shared.protocol import ProtocolError, ReplyMessage, RequestId
from vramguard.shared.redis_client import describe_data_loss
from vramguard.shared.settings import Settings
from vramguard.shared.tasks import TaskWatch, reconnect

log = logging.getLogger(__name__)


class ReplyStream:
    """The chunks of one streamed (generated) reply, in arrival order, at most `bound` waiting:
    a client that reads slower than that is cut (`overflowed`), never the listener held up."""

    def __init__(self, bound: int) -> None:
        self.queue: asyncio.Queue[ReplyMessage] = asyncio.Queue(bound)
        self.overflowed = False

    def put(self, reply: ReplyMessage) -> None:
        try:
            self.queue.put_nowait(reply)
        except asyncio.QueueFull:
            self.overflowed = True

READ_COUNT = 512  # replies taken per XREAD
INIT_FIELD = b"init"  # field of the entry that creates the reply stream (readers skip it)


class ReplyListener:
    """Owns `stream` (this gateway's reply stream) and the futures waiting on it.

    The stream carries a TTL of `reply_stream_ttl_s`, refreshed every heartbeat interval while
    the gateway lives, so a dead gateway's stream expires; workers write with NOMKSTREAM and
    never recreate it. `pause` waits the reader's back-off after a failed read (PrimaryWatch.pause
    ends it at a Sentinel failover).
    """

    def __init__(self, settings: Settings, redis: aioredis.Redis, blocking: aioredis.Redis, stream: str, *,
                 pause: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.stream = stream
        self._pause = pause
        self._settings = settings
        self._redis = redis
        self._blocking = blocking
        self._waiters: dict[RequestId, asyncio.Future[ReplyMessage]] = {}
        self._streams: dict[RequestId, ReplyStream] = {}  # streamed replies: every message, not the first
        self._last_id = b"0-0"
        self._reader: asyncio.Task[None] | None = None
        self._keepalive = Periodic("reply-keepalive", self._keep_alive, settings.heartbeat_interval_ms / 1000)
        self._stopping = False
        self.replies_dropped = 0
        # Bumped each time the reply stream is found missing (Redis restarted empty or flushed):
        # requests enqueued in an older generation were lost with it and fail at once, instead of
        # waiting out their deadline for a reply that can no longer come.
        self.generation = 0
        self._enqueued: dict[RequestId, int] = {}
        self._loss_tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<ReplyListener {self.stream} waiting={len(self._waiters)} dropped={self.replies_dropped}>"

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def register(self, request_id: RequestId) -> asyncio.Future[ReplyMessage]:
        """A future for `request_id`'s reply. Register before the XADD so a fast reply finds it."""
        future: asyncio.Future[ReplyMessage] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        return future

    def register_stream(self, request_id: RequestId, bound: int) -> ReplyStream:
        """A ReplyStream for `request_id`'s chunks. Register before the XADD; `discard` in `finally`."""
        stream = self._streams[request_id] = ReplyStream(bound)
        return stream

    def discard(self, request_id: RequestId) -> None:
        """Forget `request_id` (call in `finally`); a later reply for it is dropped."""
        self._waiters.pop(request_id, None)
        self._streams.pop(request_id, None)
        self._enqueued.pop(request_id, None)

    def mark_enqueued(self, request_id: RequestId) -> None:
        """Record that `request_id`'s entry is in Redis now, in the current generation."""
        self._enqueued[request_id] = self.generation

    def stream_lost(self) -> asyncio.Task[None]:
        """The reply stream vanished, so Redis lost its data: fail with 503 every request enqueued
        before now (their entries are gone; they would only time out). Which requests those are is
        fixed by this call, before anything else runs: a request admitted after it went into the
        new stream and must not be failed with the old ones. Returns the task that fails them (it
        first asks Redis whether the loss was an eviction, for the message)."""
        lost = [request_id for request_id, generation in self._enqueued.items() if generation == self.generation]
        self.generation += 1
        # The recreated stream's ids come from the new server's clock, which may be behind the old
        # one's: read it from its start, or every reply below the old last id would be skipped.
        self._last_id = b"0-0"
        task = asyncio.get_running_loop().create_task(self._fail_lost(lost), name="reply-stream-lost")
        self._loss_tasks.add(task)  # held until done: the loop keeps only a weak reference to a task
        task.add_done_callback(self._loss_tasks.discard)
        return task

    async def _fail_lost(self, lost: list[RequestId]) -> None:
        error = UnavailableError(await describe_data_loss(self._redis))  # never raises
        for request_id in lost:
            future = self._waiters.get(request_id)
            if future is not None and not future.done():
                future.set_exception(error)
            stream = self._streams.get(request_id)
            if stream is not None:  # a generation: its reader ends with this error (an SSE error event)
                stream.put(ReplyMessage.failure(request_id, error.code, error.message))

    def fail_all(self, error: BaseException) -> None:
        """Fail every waiting request with `error` (gateway shutdown past its grace period)."""
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)

    async def start(self) -> None:
        """Create the reply stream and start reading. With Redis down at start the stream is
        created by the keepalive once Redis answers; admission answers 503 until then."""
        try:
            await self._ensure_stream()
        except RedisError as exc:
            log.warning("cannot create the reply stream yet; Redis unreachable", extra={"error": str(exc)})
        self._reader = asyncio.create_task(self._read_loop(), name="reply-reader")
        self._keepalive.start()

    def watch(self, tasks: TaskWatch) -> None:
        """Put the reader and the keepalive under `tasks` (shared/tasks.py); call after start()."""
        assert self._reader is not None and self._keepalive.task is not None
        tasks.watch(self._reader)
        tasks.watch(self._keepalive.task)

    async def stop(self) -> None:
        """Stop reading and delete the stream. The blocked XREAD is left to return on its own
        (within block_ms): cancelling a command mid-read is what poisons redis-py connections."""
        self._stopping = True
        await self._keepalive.stop()
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=self._settings.block_ms / 1000 + 1.0)
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        try:
            await self._redis.delete(self.stream)
        except RedisError:
            pass  # it expires on its own

    async def _ensure_stream(self) -> None:
        # An init entry creates the stream so it can carry a TTL; readers skip it (no ENTRY_FIELD).
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.stream, {INIT_FIELD: b"1"}, maxlen=self._settings.reply_stream_maxlen, approximate=True)
            pipe.expire(self.stream, self._settings.reply_stream_ttl_s)
            await pipe.execute()

    async def _keep_alive(self) -> None:
        try:
            if not await self._redis.expire(self.stream, self._settings.reply_stream_ttl_s):
                log.warning("reply stream vanished (Redis restarted?); recreating", extra={"stream": self.stream})
                # Recreated first: a request admitted meanwhile (admissions check the stream only now
                # and then, gateway/admission/dispatch.py) would otherwise lose its reply to NOMKSTREAM and wait
                # for its deadline; stream_lost then fails everything enqueued before, that one too.
                await self._ensure_stream()
                await self.stream_lost()
        except Exception as exc:  # any error, as in _read_loop; the next beat tries again
            log.warning("reply stream keepalive failed", extra={"error": repr(exc)})

    async def _read_loop(self) -> None:
        backoff = ExponentialWithJitterBackoff(base=0.05, cap=2.0)
        failures = 0
        while not self._stopping:
            generation = self.generation
            try:
                response = await self._blocking.xread(
                    {self.stream: self._last_id}, count=READ_COUNT, block=self._settings.block_ms
                )
                streams = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None, response)
                for _stream, entries in streams or ():
                    await self._deliver(entries, advance=generation == self.generation)
                failures = 0
            except Exception as exc:
                # Any error, not only RedisError: a reply of an unexpected shape fails in redis-py's
                # parsing (TypeError, ValueError), and a cluster client raises RedisClusterException.
                # A reader that ended here would leave every request of this gateway to its deadline.
                failures += 1
                log.warning("reply read failed; reconnecting",
                            extra={"error": repr(exc), "failures": failures})
                await reconnect(self._blocking)
                await self._pause(backoff.compute(failures))

    def _resolve(self, reply: ReplyMessage) -> None:
        stream = self._streams.get(reply.request_id)
        if stream is not None:
            stream.put(reply)
            return
        future = self._waiters.get(reply.request_id)
        if future is None or future.done():
            self.replies_dropped += 1  # late (caller timed out) or a duplicate delivery
            return
        future.set_result(reply)

    async def _deliver(self, entries: list[tuple[bytes, dict[bytes, bytes]]], *, advance: bool) -> None:
        """Resolve the futures of `entries`; `advance`: move the read position past them (not for
        a read issued before the stream was recreated: the new stream is read from its start)."""
        ids = []
        for entry_id, fields in entries:
            ids.append(entry_id)
            if advance:
                self._last_id = entry_id
            try:
                replies = ReplyMessage.from_entry(fields)
            except ProtocolError as exc:
                log.error("undecodable reply dropped", extra={"entry_id": entry_id.decode(), "error": str(exc)})
                continue
            for reply in replies:
                self._resolve(reply)
        try:
            await self._redis.xdel(self.stream, *ids)
        except RedisError:
            pass  # bounded by MAXLEN and the TTL anyway

