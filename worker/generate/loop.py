"""The worker's main loop for a generative model: reclaimed entries first (resumed from their
progress), then new entries while the KV plan has room, then one step; blocking on the stream
only when nothing runs. A signal stops reading; the running sequences finish within
`shutdown_grace_s`, and what is left stays pending with its progress for a successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError, ResponseError

from vramguard.worker.exitcode import ExitCode
from vramguard.worker.generate.kvmeasure import build_kv_plan
from vramguard.worker.generate.server import GenerationServer
from vramguard.worker.memory.budget import MemoryBudget

if TYPE_CHECKING:
    from vramguard.worker.runner import Worker

log = logging.getLogger(__name__)


class GenerationLoop:
    """Drives a GenerationServer for `worker` (its settings, reclaimer, threads and signals)."""

    def __init__(self, worker: Worker, server: GenerationServer) -> None:
        self.worker = worker
        self.server = server

    @classmethod
    async def start(cls, worker: Worker, budget: MemoryBudget, redis: aioredis.Redis) -> GenerationLoop:
        """Measure a step, plan the KV pool inside the worker's budget and allocate it, once (on the
        model thread); publish the tokenizer for the gateways (before the first heartbeat says ready)."""
        max_running = worker.config.max_batch_size  # a step is one packed row: the batch plan's rows do not bind it
        params = worker.settings.model_config_for(worker.settings.model).params
        plan, pool = await worker.threads.run(build_kv_plan, worker.backend, budget, max_running, params)
        log.info("KV cache plan", extra={"model": worker.settings.model, **plan.as_dict()})
        server = GenerationServer(worker.settings, worker.backend, worker.worker_id, plan=plan, pool=pool,
                                  threads=worker.threads, on_oom=budget.on_oom, metrics=worker.metrics,
                                  hang=worker.hang, worker_stats=worker.stats, watchdog=worker.watchdog)
        loop = cls(worker, server)
        await loop.publish_tokenizer(redis)
        return loop

    async def publish_tokenizer(self, redis: aioredis.Redis) -> None:
        """Put the model's tokenizer in Redis for the gateways' prompt count (gateway/protocols/prompt_tokens.py),
        when the backend has one to describe. A failure only costs the gateways' early check."""
        describe = getattr(self.worker.backend, "tokenizer_description", None)
        if describe is None:
            return
        try:
            await redis.hset(self.worker.keys.tokenizer(self.worker.settings.model), mapping=describe())
        except RedisError as exc:
            log.warning("tokenizer not published; the worker alone checks the context window",
                        extra={"error": str(exc)})

    async def serve(self, redis: aioredis.Redis, blocking: aioredis.Redis) -> ExitCode:
        """Serve until a signal; returns the exit code (OK when every running sequence finished)."""
        backoff = ExponentialWithJitterBackoff(base=0.05, cap=2.0)
        failures = 0
        grace_until: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            w = self.worker
            if w.watchdog.unhealthy_reason is not None:
                return ExitCode.UNHEALTHY  # no grace: never reply from a device we no longer trust
            if w.should_exit:
                grace_until = grace_until or loop.time() + w.settings.shutdown_grace_s
                if not self.server.busy:
                    return ExitCode.OK
                if w.force_exit or loop.time() > grace_until:
                    log.warning("grace period over; sequences left pending with their progress")
                    return ExitCode.FORCED
            try:
                await self._round(redis, blocking, reading=not w.should_exit)
                failures = 0
            except RedisError as exc:
                failures += 1
                log.warning("generation round failed", extra={"error": str(exc), "failures": failures})
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    # Redis restarted empty (or the stream was deleted): the group is gone with the
                    # stream, and every later read would fail the same way until it exists again.
                    with contextlib.suppress(RedisError):
                        await w.ensure_group(redis)
                await w.primary_watch.pause(backoff.compute(failures))

    async def _round(self, redis: aioredis.Redis, blocking: aioredis.Redis, *, reading: bool) -> None:
        server, reclaimer = self.server, self.worker.reclaimer
        if reading and reclaimer is not None and reclaimer.has_work and server.room() > 0:
            suspect = await reclaimer.claim_one()
            if suspect is not None:
                if reclaimer.exhausted(suspect.delivery_count):
                    await reclaimer.dead_letter(suspect, self.worker.settings.reply_stream_maxlen)
                else:
                    await server.take(redis, [suspect.entry])
            return
        if reading:
            busy = server.busy
            entries = await server.read(redis if busy else blocking, None if busy else self.worker.settings.block_ms)
            await server.take(redis, entries)
        if server.busy:
            await server.step(redis)
            # A decode step that ran is the device answering, as a batch is for the other models:
            # without it readiness would call a worker busy generating for minutes not live.
            self.worker.watchdog.mark_ok()
        elif self.worker.watchdog.probe_due:
            await self.worker.watchdog.probe()
