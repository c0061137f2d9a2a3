"""Hops 3-4 for one batch that was read: `BatchServer.serve` triages the entries (expired,
undecodable, invalid, too large for the memory budget), runs the rest in cost groups through
`run_batch` and publishes each group's replies together with its XACK + XDEL.

The worker's lifecycle (reading, reclaim, signals, drain) is runner.py's; this module never
reads a stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.clock import monotonic_ms, now_ms
from vramguard.shared.errors import DeadlineExceededError, InputTooLargeError, ModelError, VramguardError
from vramguard.shared.keys import Keys
from vramguard.shared.models import ModelConfig
from vramguard.shared.protocol import EntryId, ReplyMessage
from vramguard.shared.settings import Settings
from vramguard.worker.backend import ModelBackend
from vramguard.worker.batcher import Entry
from vramguard.worker.costing import group_by_cost
from vramguard.worker.execlog import ExecutionLog
from vramguard.worker.execute import CudaContextLost, ItemResult, run_batch
from vramguard.worker.hang import HangGuard
from vramguard.worker.heartbeat import WorkerStats
from vramguard.worker.memory import MemoryBudget
from vramguard.worker.metrics import WorkerMetrics
from vramguard.worker.publish import DeadLetter, Outgoing, publish_replies
from vramguard.worker.watchdog import Watchdog

log = logging.getLogger(__name__)


class BatchServer:
    """Serves batches for one worker: `worker_id` on `settings.model`, within `budget`.

    `on_context_lost` is called (once per batch) when a forward raised CudaContextLost; the
    worker then exits without acking (DESIGN.md "Memory").
    """

    def __init__(
        self, settings: Settings, backend: ModelBackend, worker_id: str, *, stats: WorkerStats,
        metrics: WorkerMetrics, watchdog: Watchdog, budget: MemoryBudget | None,
        on_context_lost: Callable[[], None], hang: HangGuard | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._config: ModelConfig = settings.model_config_for(settings.model)
        self.worker_id = worker_id
        self._keys = Keys(settings.key_prefix)
        self._stream = self._keys.request_stream(settings.model)
        self._stats = stats
        self._metrics = metrics
        self._watchdog = watchdog
        self.budget = budget
        self._on_context_lost = on_context_lost
        self._executions = ExecutionLog(settings)
        self._hang = hang or HangGuard(lambda *_: None)  # the runner's guard ends a hung forward
        # Set once any forward of this worker lost the device context: from then on no forward's
        # results are published, also those of concurrent batches that finished afterwards,
        # since they ran on a device that can no longer be trusted.
        self.context_lost = False

    async def serve(self, redis: aioredis.Redis, entries: list[Entry]) -> bool:
        """Triage, then serve the live entries in cost groups (worker/costing.py), cheapest first,
        publishing each group as soon as it is done. Immediate replies (expired, invalid, too large
        for the memory budget) go out first. Returns False when the device context was lost: the
        rest of the batch stays pending, un-acked, for a fresh process to reclaim."""
        batch_start_ms = now_ms()
        outgoing, dead, live = await asyncio.to_thread(self._triage, entries, batch_start_ms)  # decode: CPU work
        costs = await asyncio.to_thread(lambda: [[self._backend.item_cost(i) for i in items] for _e, items in live])
        outgoing.extend(self._refuse_too_large(live, costs))
        kept = [k for k, c in enumerate(costs) if self._fits_alone(c)]
        live_ids = {live[k][0].entry_id for k in kept}
        if outgoing or dead:
            self._stats.errors += len(outgoing)
            await self._publish(redis, outgoing, [e.entry_id for e in entries if e.entry_id not in live_ids], dead)
        budget_cost = self.budget.max_batch_cost if self.budget is not None else None
        for group in group_by_cost([costs[k] for k in kept], self._config.max_batch_size, budget_cost):
            members = [(live[kept[g]], costs[kept[g]]) for g in group]
            members = await self._drop_expired(redis, members)  # earlier groups may have outlived a deadline
            if not members:
                continue
            ok = await self._serve_group(redis, [m for m, _c in members], [c for _m, c in members], batch_start_ms)
            if not ok:
                return False  # the context is lost: nothing more is computed or acked
        return True

    async def _drop_expired(
        self, redis: aioredis.Redis, members: list[tuple[tuple[Entry, list[object]], list[int]]]
    ) -> list[tuple[tuple[Entry, list[object]], list[int]]]:
        """Answer `deadline_exceeded` (and ack) for members whose deadline passed while earlier
        groups of the same read ran; return the others. No forward is spent on a request whose
        caller has already been answered 504 by the gateway."""
        now = now_ms()
        expired = [m for m in members if m[0][0].message is not None and m[0][0].message.deadline_ms <= now]
        if not expired:
            return members
        self._stats.expired += len(expired)
        replies = [self._failure(entry, DeadlineExceededError.code, "deadline passed before its group ran")
                   for (entry, _items), _c in expired]
        gone = {entry.entry_id for (entry, _items), _c in expired}
        await self._publish(redis, replies, list(gone), [])
        return [m for m in members if m[0][0].entry_id not in gone]

    def _fits_alone(self, entry_costs: list[int]) -> bool:
        return self.budget is None or all(self.budget.fits_alone(c) for c in entry_costs)

    def _refuse_too_large(self, live: list[tuple[Entry, list[object]]], costs: list[list[int]]) -> list[Outgoing]:
        """413 input_too_large at once for an entry with an item that cannot fit the budget even alone."""
        out = []
        for (entry, _items), entry_costs in zip(live, costs, strict=True):
            if not self._fits_alone(entry_costs):
                assert self.budget is not None
                message = (f"an input costs {max(entry_costs)} (tokens or items); the memory budget allows "
                           f"{self.budget.plan.max_batch_cost} per forward")
                out.append(self._failure(entry, InputTooLargeError.code, message))
        return out

    async def _serve_group(
        self, redis: aioredis.Redis, group: list[tuple[Entry, list[object]]], costs: list[list[int]],
        batch_start_ms: int,
    ) -> bool:
        """Run one cost group and publish its replies. False when the device context was lost
        (the entries stay pending, un-acked, and the worker exits)."""
        items = [item for _entry, entry_items in group for item in entry_items]
        request_ids = [e.message.request_id for e, _i in group if e.message is not None]
        await self._executions.record(redis, request_ids)
        started = monotonic_ms()
        try:
            with self._hang.forward("batch", request_ids):
                results, stats = await asyncio.to_thread(
                    run_batch, self._backend, items, self._config.max_batch_size, budget=self.budget,
                    costs=[c for entry_costs in costs for c in entry_costs],
                )
        except CudaContextLost as exc:
            log.error("device context lost; exiting without acking",
                      extra={"error": str(exc), "batch_size": len(items)})
            self.context_lost = True
            self._on_context_lost()
            return False
        if self.context_lost:  # another batch's forward broke the context while this one ran
            return False
        duration_ms = monotonic_ms() - started
        outgoing = self._replies(group, results, len(items), batch_start_ms, costs)
        delays_ms = [float(batch_start_ms - e.message.enqueued_ms) for e, _ in group if e.message is not None]
        self._watchdog.record_batch(results)
        if self._watchdog.verify_due:  # many failed batches in a row: the inputs, or the device?
            await self._watchdog.verify()
        self._metrics.observe_batch(len(items), delays_ms, duration_ms)
        log.info("batch done", extra={"model": self._settings.model, "worker_id": self.worker_id,
                                      "batch_size": len(items), "requests": len(group), "forwards": stats.forwards,
                                      "oom_events": stats.oom_events, "queue_delay_ms": max(delays_ms, default=0.0),
                                      "duration_ms": round(duration_ms, 2)})
        self._stats.record_batch(len(items), len(group), stats.forwards, sum(1 for o in outgoing if not o.reply.ok),
                                sum(delays_ms))
        await self._publish(redis, outgoing, [e.entry_id for e, _items in group], [])
        return True

    async def _publish(
        self, redis: aioredis.Redis, outgoing: list[Outgoing], entry_ids: list[EntryId], dead: list[DeadLetter]
    ) -> None:
        try:
            await publish_replies(
                redis, request_stream=self._stream,
                dead_letter_stream=self._keys.dead_letter_stream(self._settings.model),
                replies=outgoing, entry_ids=entry_ids, dead_letters=dead,
                reply_maxlen=self._settings.reply_stream_maxlen,
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
                log.error("undecodable entry to dead letter",
                          extra={"entry_id": entry.entry_id, "error": entry.decode_error})
                dead.append(DeadLetter(entry.entry_id, entry.fields, entry.decode_error or "undecodable"))
                continue
            if msg.deadline_ms <= batch_start_ms:
                self._stats.expired += 1
                outgoing.append(self._failure(entry, DeadlineExceededError.code, "deadline passed while queued"))
                continue
            try:
                items = self._backend.decode(msg.inputs, msg.parameters)
                if len(items) != len(msg.inputs):  # else replies would pair outputs with the wrong inputs
                    raise ModelError(f"decode returned {len(items)} items for {len(msg.inputs)} inputs")
                live.append((entry, items))
            except VramguardError as exc:  # InvalidInputError 422, InputTooLargeError 413: this request only
                outgoing.append(self._failure(entry, exc.code, exc.message))
            except Exception as exc:  # noqa: BLE001 - a bug in a model's decode fails its request, not the batch
                log.exception("decode raised", extra={"entry_id": entry.entry_id})
                outgoing.append(self._failure(entry, ModelError.code, f"decode raised {type(exc).__name__}: {exc}"))
        return outgoing, dead, live

    def _failure(self, entry: Entry, code: str, message: str) -> Outgoing:
        assert entry.message is not None
        return Outgoing(entry.message.reply_to, ReplyMessage.failure(entry.message.request_id, code, message,
                                                                     worker_id=self.worker_id))

    def _replies(
        self, live: list[tuple[Entry, list[object]]], results: list[ItemResult], batch_size: int, batch_start_ms: int,
        costs: list[list[int]],
    ) -> list[Outgoing]:
        out: list[Outgoing] = []
        offset = 0
        for (entry, items), entry_costs in zip(live, costs, strict=True):
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
                reply = ReplyMessage(request_id=msg.request_id, outputs=[r.output for r in mine],
                                     cost=sum(entry_costs), **common)  # type: ignore[arg-type]
            out.append(Outgoing(msg.reply_to, reply))
        return out
