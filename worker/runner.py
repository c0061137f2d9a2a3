"""The worker's lifecycle: connect, load and warm up the model, then read batches, run them
and publish replies until told to stop. The main loop reads like DESIGN.md's hops:

    read_batch (batcher.py) -> decode + drop expired (here) -> run_batch (execute.py)
    -> publish_replies (publish.py)

Signals only set flags (uvicorn's pattern): the first SIGTERM/SIGINT stops reading and drains
the batches in flight; a second one, or `shutdown_grace_s` passing, exits at once and leaves
un-acked entries pending for another worker to reclaim.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from enum import IntEnum

import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError, ResponseError

from shared.clock import monotonic_ms, now_ms
from shared.errors import DeadlineExceededError, InvalidInputError
from shared.keys import GROUP, Keys
from shared.protocol import EntryId, ReplyMessage
from shared.redis_client import connect, connect_blocking
from shared.settings import Settings
from worker.backend import ModelBackend
from worker.batcher import Batcher, Entry
from worker.execute import ItemResult, run_batch
from worker.heartbeat import Heartbeat, WorkerStats
from worker.publish import DeadLetter, Outgoing, publish_replies

log = logging.getLogger(__name__)


class ExitCode(IntEnum):
    """Process exit codes; supervisor restarts on anything but OK."""

    OK = 0
    STARTUP_FAILED = 3  # Redis unreachable at start, model failed to load
    FORCED = 4  # second signal or grace period over: in-flight batches left for reclaim


class Worker:
    """Serves `backend` for `settings.model` as consumer `worker_id` of the `workers` group.

    `max_batches` bounds the run (tests, like arq's burst mode): the worker stops reading after
    that many batches and drains.
    """

    def __init__(self, settings: Settings, backend: ModelBackend, *, max_batches: int | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.config = settings.model_config_for(settings.model)
        self.worker_id = settings.consumer_name
        self.keys = Keys(settings.key_prefix)
        self.stream = self.keys.request_stream(settings.model)
        self.stats = WorkerStats()
        self.should_exit = False
        self.force_exit = False
        self._max_batches = max_batches
        self._inflight: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"<Worker {self.worker_id} {self.settings.model}@{self.backend.device} {s.state} "
            f"batches={s.batches} items={s.items} max_batch_seen={s.max_batch_seen} errors={s.errors}>"
        )

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit, sig)

    def handle_exit(self, sig: int) -> None:
        """First signal: drain. Second: force (uvicorn's two-step shutdown)."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        log.info("signal received", extra={"signal": signal.Signals(sig).name, "force": self.force_exit})

    async def run(self) -> ExitCode:
        """Run until a signal or `max_batches`; returns the exit code for `sys.exit`."""
        redis = connect(self.settings)
        blocking = connect_blocking(self.settings)
        try:
            return await self._run(redis, blocking)
        finally:
            await blocking.aclose()
            await redis.aclose()

    async def _run(self, redis: aioredis.Redis, blocking: aioredis.Redis) -> ExitCode:
        try:
            await self.ensure_group(redis)
            await asyncio.to_thread(self.warm_up)
        except RedisError as exc:
            log.error("cannot reach Redis at start", extra={"error": str(exc)})
            return ExitCode.STARTUP_FAILED
        heartbeat = Heartbeat(
            self.settings, redis, self.keys, self.worker_id, self.settings.model, self.stats,
            {"device": self.backend.device, "max_batch_size": self.config.max_batch_size,
             "max_wait_ms": self.config.max_wait_ms},
        )
        self.stats.state = "ready"
        heartbeat.start()
        log.info("worker ready", extra={"worker_id": self.worker_id, "model": self.settings.model,
                                        "device": self.backend.device, "settings": self.settings.masked()})
        try:
            await self._serve_forever(redis, blocking)
            self.stats.state = "draining"
            return await self._drain()
        finally:
            await heartbeat.stop()

    async def ensure_group(self, redis: aioredis.Redis) -> None:
        """Create the request stream and the `workers` group if missing (a fresh or restarted Redis)."""
        try:
            await redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def warm_up(self) -> None:
        """Load the weights and run the example inputs once (blocking; call in a thread)."""
        started = monotonic_ms()
        self.backend.load()
        items = self.backend.decode(self.backend.example_inputs())
        results, _ = run_batch(self.backend, items, self.config.max_batch_size)
        failed = [r.error_message for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"warmup failed: {failed[0]}")
        log.info("warmup done", extra={"duration_ms": round(monotonic_ms() - started, 1)})

    async def _serve_forever(self, redis: aioredis.Redis, blocking: aioredis.Redis) -> None:
        batcher = Batcher(
            blocking, self.stream, self.worker_id,
            max_batch_size=self.config.max_batch_size, max_wait_ms=self.config.max_wait_ms,
            block_ms=self.settings.block_ms,
        )
        slots = asyncio.Semaphore(self.config.max_inflight_batches)
        backoff = ExponentialWithJitterBackoff(base=0.05, cap=2.0)
        failures = read = 0
        while not self.should_exit and (self._max_batches is None or read < self._max_batches):
            await slots.acquire()
            try:
                entries = await batcher.read_batch()
                failures = 0
            except RedisError as exc:
                slots.release()
                failures += 1
                log.warning("read failed", extra={"error": str(exc), "failures": failures})
                await self._recover(redis, exc, backoff.compute(failures))
                continue
            if not entries:
                slots.release()
                continue
            read += 1
            task = asyncio.create_task(self._serve_batch(redis, entries))
            self._inflight.add(task)
            task.add_done_callback(lambda t: (self._inflight.discard(t), slots.release()))

    async def _recover(self, redis: aioredis.Redis, exc: RedisError, delay_s: float) -> None:
        if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
            try:
                await self.ensure_group(redis)  # Redis restarted empty
                return
            except RedisError:
                pass
        await asyncio.sleep(delay_s)

    async def _drain(self) -> ExitCode:
        if not self._inflight:
            return ExitCode.OK
        done, pending = await asyncio.wait(set(self._inflight), timeout=self.settings.shutdown_grace_s)
        if pending or self.force_exit:
            log.warning("grace period over; leaving batches for reclaim", extra={"batches": len(pending)})
            return ExitCode.FORCED
        return ExitCode.OK

    async def _serve_batch(self, redis: aioredis.Redis, entries: list[Entry]) -> None:
        batch_start_ms = now_ms()
        outgoing, dead, live = self._triage(entries, batch_start_ms)
        items = [item for _entry, entry_items in live for item in entry_items]
        forwards = 0
        if items:
            started = monotonic_ms()
            results, stats = await asyncio.to_thread(run_batch, self.backend, items, self.config.max_batch_size)
            forwards = stats.forwards
            outgoing.extend(self._replies(live, results, len(items), batch_start_ms))
            log.info("batch done", extra={"model": self.settings.model, "worker_id": self.worker_id,
                                          "batch_size": len(items), "requests": len(live),
                                          "duration_ms": round(monotonic_ms() - started, 2)})
        errors = sum(1 for o in outgoing if not o.reply.ok)
        queue_delay_ms = sum(batch_start_ms - entry.message.enqueued_ms for entry, _ in live if entry.message)
        self.stats.record_batch(len(items), len(live), forwards, errors, queue_delay_ms)
        try:
            await publish_replies(
                redis, request_stream=self.stream, dead_letter_stream=self.keys.dead_letter_stream(self.settings.model),
                replies=outgoing, entry_ids=[e.entry_id for e in entries], dead_letters=dead,
                reply_maxlen=self.settings.reply_stream_maxlen,
            )
        except RedisError as exc:
            log.error("publish failed; entries stay pending for reclaim", extra={"error": str(exc)})

    def _triage(
        self, entries: list[Entry], batch_start_ms: int
    ) -> tuple[list[Outgoing], list[DeadLetter], list[tuple[Entry, list[object]]]]:
        """Split a batch into immediate replies (expired, invalid), dead letters (undecodable)
        and live entries with their decoded items."""
        outgoing: list[Outgoing] = []
        dead: list[DeadLetter] = []
        live: list[tuple[Entry, list[object]]] = []
        for entry in entries:
            msg = entry.message
            if msg is None:
                log.error("undecodable entry to dead letter", extra={"entry_id": entry.entry_id, "error": entry.decode_error})
                dead.append(DeadLetter(entry.entry_id, entry.fields, entry.decode_error or "undecodable"))
                continue
            if msg.deadline_ms <= batch_start_ms:
                self.stats.expired += 1
                outgoing.append(self._failure(entry, DeadlineExceededError.code, "deadline passed while queued"))
                continue
            try:
                live.append((entry, self.backend.decode(msg.inputs)))
            except InvalidInputError as exc:
                outgoing.append(self._failure(entry, exc.code, exc.message))
        return outgoing, dead, live

    def _failure(self, entry: Entry, code: str, message: str) -> Outgoing:
        assert entry.message is not None
        return Outgoing(entry.message.reply_to, ReplyMessage.failure(entry.message.request_id, code, message,
                                                                     worker_id=self.worker_id))

    def _replies(
        self, live: list[tuple[Entry, list[object]]], results: list[ItemResult], batch_size: int, batch_start_ms: int
    ) -> list[Outgoing]:
        out: list[Outgoing] = []
        offset = 0
        for entry, items in live:
            msg = entry.message
            assert msg is not None
            mine = results[offset : offset + len(items)]
            offset += len(items)
            failed = next((r for r in mine if not r.ok), None)
            common = {"worker_id": self.worker_id, "batch_size": batch_size,
                      "queue_delay_ms": float(batch_start_ms - msg.enqueued_ms)}
            if failed is not None:
                reply = ReplyMessage.failure(msg.request_id, failed.error_code or "model_error",
                                             failed.error_message or "", **common)
            else:
                reply = ReplyMessage(request_id=msg.request_id, outputs=[r.output for r in mine], **common)  # type: ignore[arg-type]
            out.append(Outgoing(msg.reply_to, reply))
        return out


__all__ = ["ExitCode", "Worker", "EntryId"]
