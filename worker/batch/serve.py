"""Hops 3-4 for one batch that was read: `BatchServer.serve` triages the entries (expired,
undecodable, invalid, too large for the memory budget), runs the rest in cost groups through
`run_batch` and publishes each group's replies together with its XACK + XDEL.

The worker's lifecycle (reading, reclaim, signals, drain) is runner.py's; this module never
reads a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.clock import monotonic_ms, now_ms
from vramguard.shared.errors import DeadlineExceededError, InputTooLargeError, ModelError, VramguardError
from vramguard.shared.keys import Keys
from vramguard.shared.models import ModelConfig
from vramguard.shared.protocol import EntryId, ReplyMessage
from vramguard.shared.settings import Settings
from vramguard.shared.tracing import shared_ms_to_ns, tracer
from vramguard.worker.backend import ModelBackend
from vramguard.worker.batch.batcher import Held, Slice
from vramguard.worker.batch.costing import group_by_cost
from vramguard.worker.batch.entries import Entry, PackLedger
from vramguard.worker.batch.execlog import ExecutionLog
from vramguard.worker.batch.execute import BatchStats, ItemResult, run_batch
from vramguard.worker.batch.publish import DeadLetter, Outgoing, publish_replies
from vramguard.worker.health.hang import HangGuard
from vramguard.worker.health.heartbeat import WorkerStats
from vramguard.worker.health.watchdog import Watchdog
from vramguard.worker.memory.budget import MemoryBudget
from vramguard.worker.memory.oom import CudaContextLost
from vramguard.worker.metrics import WorkerMetrics
from vramguard.worker.modelthreads import ModelThreads
from vramguard.worker.spans import GroupTimes, plan_attributes, record_group, record_queued

log = logging.getLogger(__name__)


class BatchServer:
    """Serves batches for one worker: `worker_id` on `settings.model`, within `budget`.

    `on_context_lost` is called (once per batch) when a forward raised CudaContextLost; the
    worker then exits without acking (docs/concepts/architecture.md "Memory").
    """

    def __init__(
        self, settings: Settings, backend: ModelBackend, worker_id: str, *, stats: WorkerStats,
        metrics: WorkerMetrics, watchdog: Watchdog, budget: MemoryBudget | None,
        on_context_lost: Callable[[], None], threads: ModelThreads, hang: HangGuard | None = None,
        ledger: PackLedger | None = None,
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
        self._threads = threads
        self._executions = ExecutionLog(settings)
        self._hang = hang or HangGuard(lambda *_: None)  # the runner's guard ends a hung forward
        # The packs the batcher read (worker/batch/entries.py): their requests are acked through it.
        self.ledger = ledger if ledger is not None else PackLedger()
        # Set once any forward of this worker lost the device context: from then on no forward's
        # results are published, also those of concurrent batches that finished afterwards,
        # since they ran on a device that can no longer be trusted.
        self.context_lost = False
        # Entries being served, by id: their triage (a future, so that a concurrent batch holding
        # another slice of the entry waits for it), then their decoded items and results so far.
        self._parts: dict[EntryId, asyncio.Future[_Parts | None]] = {}

    async def serve(self, redis: aioredis.Redis, batch: Sequence[Slice]) -> bool:
        """Triage the entries seen for the first time, then serve the batch's live slices in cost
        groups (worker/batch/costing.py), cheapest first, publishing each group as soon as it is done.
        Immediate replies (expired, invalid, too large for the memory budget) go out first. An
        entry is answered and acked when its last item is done: a large one served in slices
        over several batches is reassembled in item order first. Returns False when the device
        context was lost: the rest stays pending, un-acked, for a fresh process to reclaim."""
        batch_start_ms = now_ms()
        fresh = self._claim_fresh(batch)
        record_queued([held.entry for held in fresh], batch_start_ms, self.worker_id)  # when tracing is on
        try:
            await self._triage_fresh(redis, fresh, batch_start_ms)
        except BaseException:
            for held in fresh:  # a bug in triage: nobody may wait forever on these entries
                future = self._parts.pop(held.entry.entry_id, None)
                if future is not None and not future.done():
                    future.set_result(None)
            raise
        live: list[tuple[Slice, _Parts]] = []
        for part in batch:
            parts = await self._parts[part.entry_id] if part.entry_id in self._parts else None
            if parts is not None and not part.held.closed:
                live.append((part, parts))
        try:
            return await self._serve_live(redis, live, batch_start_ms)
        except BaseException:  # the runner answers the batch's entries (or leaves them pending): forget them
            for part in batch:
                self._parts.pop(part.entry_id, None)
            raise

    async def _serve_live(self, redis: aioredis.Redis, live: list[_Member], batch_start_ms: int) -> bool:
        budget_cost = self.budget.max_batch_cost if self.budget is not None else None
        live = await self._drop_cancelled(redis, live)
        for group in group_by_cost([parts.costs[s.start : s.stop] for s, parts in live], self._config.max_batch_size,
                                   budget_cost,
                                   pad_factor=self._config.pad_factor):
            # Earlier groups (or batches) may have outlived a deadline.
            members = await self._drop_expired(redis, [live[g] for g in group])
            if not members:
                continue
            if not await self._serve_group(redis, members, batch_start_ms):
                return False  # the context is lost: nothing more is computed or acked
        return True

    def _claim_fresh(self, batch: Sequence[Slice]) -> list[Held]:
        """The entries of `batch` seen for the first time, each registered with a future that
        its triage resolves (a concurrent batch holding another slice of it awaits that)."""
        fresh: dict[EntryId, Held] = {}
        loop = asyncio.get_running_loop()
        for part in batch:
            if part.entry_id not in self._parts and not part.held.closed:
                fresh[part.entry_id] = part.held
                self._parts[part.entry_id] = loop.create_future()
        return list(fresh.values())

    async def _triage_fresh(self, redis: aioredis.Redis, fresh: list[Held], batch_start_ms: int) -> None:
        """Decode and cost the entries seen for the first time; answer those that cannot be
        served (expired, undecodable, invalid, too large) at once and close them."""
        # Decoding and costing in one thread hop: each hop is a thread wake-up, paid once per batch.
        outgoing, dead, live, costs = await self._threads.run(self._triage_and_cost, [h.entry for h in fresh],
                                                              batch_start_ms)
        for (entry, items), entry_costs in zip(live, costs, strict=True):
            if self._fits_alone(entry_costs):
                self._parts[entry.entry_id].set_result(_Parts(items, entry_costs, batch_start_ms))
            else:
                outgoing.append(self._too_large(entry, entry_costs))
        answered = [h for h in fresh if not self._parts[h.entry.entry_id].done()]
        for held in answered:
            held.closed = True
            self._parts.pop(held.entry.entry_id).set_result(None)
        if outgoing or dead:
            self._stats.errors += len(outgoing)
            await self._publish(redis, outgoing, [h.entry.entry_id for h in answered], dead)

    def _triage_and_cost(self, entries: list[Entry], batch_start_ms: int) -> tuple[
            list[Outgoing], list[DeadLetter], list[tuple[Entry, list[object]]], list[list[int]]]:
        """`_triage`, then each live entry's item costs (backend.item_cost); runs on a model thread,
        under the hang guard's decode timeout: a decoder that never returns ends the worker too."""
        request_ids = [e.message.request_id for e in entries if e.message is not None]
        n_items = sum(e.message.n_items for e in entries if e.message is not None)
        with self._hang.forward("decode", request_ids, self._hang.decode_limit_s(n_items)):
            outgoing, dead, live = self._triage(entries, batch_start_ms)
            return outgoing, dead, live, [[self._backend.item_cost(i) for i in items] for _e, items in live]

    async def _drop_expired(self, redis: aioredis.Redis, members: list[_Member]) -> list[_Member]:
        """Answer `deadline_exceeded` (and ack) for members whose deadline passed while earlier
        groups or batches ran (a large entry partly served included); return the others. No
        forward is spent on a request whose caller has already been answered 504 by the gateway."""
        now = now_ms()
        expired = [m for m in members if m[0].message is not None and m[0].message.deadline_ms <= now]
        if not expired:
            return members
        self._stats.expired += len(expired)
        replies = [self._failure(part.entry, DeadlineExceededError.code, "deadline passed before its group ran")
                   for part, _parts in expired]
        await self._publish(redis, replies, self._close(expired), [])
        return [m for m in members if not m[0].held.closed]

    async def _drop_cancelled(self, redis: aioredis.Redis, members: list[_Member]) -> list[_Member]:
        """Ack, without computing or answering, the members whose client left (the gateway's cancel
        key, gateway/inference.py); return the others. One MGET of their cancel keys for the batch.
        A Redis error here only costs the check: the batch is computed."""
        asked = [m for m in members if m[0].message is not None]
        if not asked:
            return members
        try:
            flags = await redis.mget([self._keys.cancel(self._settings.model, m[0].message.request_id)  # type: ignore[union-attr]
                                      for m in asked])
        except RedisError as exc:
            log.warning("cancel marks not read; the batch is computed", extra={"error": str(exc)})
            return members
        gone = [m for m, flag in zip(asked, flags, strict=True) if flag is not None]
        if not gone:
            return members
        self._stats.cancelled += len(gone)
        await self._publish(redis, [], self._close(gone), [])
        log.info("requests cancelled before their batch ran", extra={"requests": len(gone)})
        return [m for m in members if not m[0].held.closed]

    def _close(self, members: list[_Member]) -> list[EntryId]:
        """Mark `members` answered without a forward and forget their parts; their entry ids, to ack."""
        for part, _parts in members:
            part.held.closed = True
            self._parts.pop(part.entry_id, None)
        return [part.entry_id for part, _parts in members]

    def _fits_alone(self, entry_costs: list[int]) -> bool:
        """Whether each item of an entry fits the memory budget alone (fits_alone is a bound on
        one item's cost, so its largest decides)."""
        return self.budget is None or self.budget.fits_alone(max(entry_costs, default=0))

    def _too_large(self, entry: Entry, entry_costs: list[int]) -> Outgoing:
        """413 input_too_large at once for an entry with an item that cannot fit the budget even alone."""
        assert self.budget is not None
        message = (f"an input costs {max(entry_costs)} (tokens or items); the memory budget allows "
                   f"{self.budget.plan.max_batch_cost} per forward")
        return self._failure(entry, InputTooLargeError.code, message)

    async def _serve_group(self, redis: aioredis.Redis, group: list[_Member], batch_start_ms: int) -> bool:
        """Run one cost group, then publish the replies of the entries it completed. False when
        the device context was lost (the entries stay pending, un-acked, and the worker exits)."""
        items = [item for part, parts in group for item in parts.items[part.start : part.stop]]
        request_ids = list(dict.fromkeys(p.message.request_id for p, _ in group if p.message is not None))
        await self._executions.record(redis, request_ids)
        costs = [c for part, parts in group for c in parts.costs[part.start : part.stop]]
        times = GroupTimes(shared_ms_to_ns(batch_start_ms), forward_start_ns=time.time_ns())
        started = monotonic_ms()

        def guard(padded_cost: int) -> AbstractContextManager[None]:  # each forward on its own timeout
            return self._hang.forward("batch", request_ids, self._hang.forward_limit_s(padded_cost))

        try:
            results, stats = await self._threads.run(
                run_batch, self._backend, items, self._config.max_batch_size, budget=self.budget, costs=costs,
                guard=guard,
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
        times.forward_end_ns = time.time_ns()
        completed = self._collect(group, results)
        outgoing = [self._reply(part.entry, parts, len(items)) for part, parts in completed]
        # Queue delay once per request: at the batch that started it, not at each later slice.
        delays_ms = [float(batch_start_ms - p.message.enqueued_ms) for p, _ in group if p.message and p.start == 0]
        self._watchdog.record_batch(results)
        if self._watchdog.verify_due:  # many failed batches in a row: the inputs, or the device?
            await self._watchdog.verify()
        self._metrics.observe_batch(len(items), delays_ms, duration_ms)
        log.info("batch done", extra={"model": self._settings.model, "worker_id": self.worker_id,
                                      "batch_size": len(items), "requests": len(group), "forwards": stats.forwards,
                                      "completed": len(completed), "oom_events": stats.oom_events,
                                      "queue_delay_ms": max(delays_ms, default=0.0),
                                      "duration_ms": round(duration_ms, 2)})
        self._stats.record_batch(len(items), len(delays_ms), stats.forwards, sum(1 for o in outgoing if not o.reply.ok),
                                sum(delays_ms))  # requests: counted once, at their first slice (as their delay)
        times.publish_start_ns = time.time_ns()
        await self._publish(redis, outgoing, [part.entry_id for part, _parts in completed], [])
        times.publish_end_ns = time.time_ns()
        if tracer() is not None:
            self._trace_group(group, costs, stats, times)
        return True

    def _trace_group(self, group: list[_Member], costs: list[int], stats: BatchStats, times: GroupTimes) -> None:
        """The group's spans in each traced request's trace (worker/spans.py): its size in items,
        requests, cost, forwards, OOM events and the memory plan it ran under."""
        batch = {"vramguard.batch.size": len(costs), "vramguard.batch.requests": len(group),
                 "vramguard.batch.cost": sum(costs), "vramguard.batch.forwards": stats.forwards,
                 "vramguard.batch.oom_events": stats.oom_events,
                 **plan_attributes(self.budget, len(costs), max(costs, default=0))}
        record_group([part.entry for part, _parts in group], times, batch, self.worker_id)

    def _collect(self, group: list[_Member], results: list[ItemResult]) -> list[_Member]:
        """Store each slice's results in its entry's parts, in item order; return the members
        whose entry now has every item done (their parts are forgotten: they are answered now).
        An entry answered meanwhile (its deadline passed in a concurrent batch) is skipped."""
        completed: list[_Member] = []
        offset = 0
        for part, parts in group:
            parts.results[part.start : part.stop] = results[offset : offset + part.n_items]
            offset += part.n_items
            parts.done += part.n_items
            future = self._parts.get(part.entry_id)
            if parts.done == len(parts.items) and future is not None and future.result() is parts:
                del self._parts[part.entry_id]
                completed.append((part, parts))
        return completed

    async def _publish(
        self, redis: aioredis.Redis, outgoing: list[Outgoing], entry_ids: list[EntryId], dead: list[DeadLetter]
    ) -> None:
        try:
            await publish_replies(
                redis, request_stream=self._stream,
                dead_letter_stream=self._keys.dead_letter_stream(self._settings.model),
                queued_requests=self._keys.queued_requests(self._settings.model),
                replies=outgoing, entry_ids=entry_ids, dead_letters=dead,
                reply_maxlen=self._settings.reply_stream_maxlen, ledger=self.ledger,
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

    def _reply(self, entry: Entry, parts: _Parts, batch_size: int) -> Outgoing:
        """The reply of an entry whose items are all done: its outputs in order, or the first
        item's error (as for an unsplit request)."""
        msg = entry.message
        assert msg is not None
        results = cast(list[ItemResult], parts.results)
        failed = next((r for r in results if not r.ok), None)
        common = {"worker_id": self.worker_id, "batch_size": batch_size,
                  "queue_delay_ms": float(parts.first_batch_ms - msg.enqueued_ms)}
        if failed is not None:
            # The item's own log line ("model raised") cannot name the request: this one does.
            log.warning("request failed", extra={"request_id": msg.request_id, "code": failed.error_code,
                                                 "error": failed.error_message})
            reply = ReplyMessage.failure(msg.request_id, failed.error_code or "model_error",
                                         failed.error_message or "", **common)
        else:
            reply = ReplyMessage(request_id=msg.request_id, outputs=[r.output for r in results],
                                 cost=sum(parts.costs), **common)  # type: ignore[arg-type]
        return Outgoing(msg.reply_to, reply)


@dataclass(slots=True, eq=False)
class _Parts:
    """A live entry's decoded items and costs, and the results of its slices done so far (in
    item order; None where not yet run). `first_batch_ms`: when its first batch started."""

    items: list[object]
    costs: list[int]
    first_batch_ms: int
    results: list[ItemResult | None] = field(default_factory=list)
    done: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.items)


_Member = tuple[Slice, _Parts]
