"""The worker's lifecycle: connect, load and warm up the model, then read batches, run them
and publish replies until told to stop. The main loop reads like docs/concepts/architecture.md's hops:

    read_batch (batcher.py) -> BatchServer.serve (serve.py): decode + drop expired, cost
    groups, run_batch (execute.py), publish_replies (publish.py)

Entries of dead workers (and of this consumer name's previous life) come back through
reclaim.py and are served first, one at a time and alone, or dead-lettered.

Signals only set flags (uvicorn's pattern): the first SIGTERM/SIGINT stops reading and drains
the batches in flight; a second one, or `shutdown_grace_s` passing, exits at once and leaves
un-acked entries pending for another worker to reclaim.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from vramguard.shared.clock import monotonic_ms, now_ms
from vramguard.shared.clocksync import ClockSync
from vramguard.shared.errors import UnavailableError
from vramguard.shared.failover import PrimaryWatch
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import EntryId
from vramguard.shared.redis_client import check_eviction_policy, close, connect, connect_blocking
from vramguard.shared.settings import Settings
from vramguard.shared.tasks import TaskWatch
from vramguard.worker.backend import ModelBackend
from vramguard.worker.batch.batch_errors import answer_internal_error
from vramguard.worker.batch.batcher import Batcher, Slice
from vramguard.worker.batch.entries import PackLedger, stream_ids
from vramguard.worker.batch.execute import run_batch
from vramguard.worker.batch.reclaim import Reclaimer, Suspect
from vramguard.worker.batch.serve import BatchServer
from vramguard.worker.exitcode import ExitCode
from vramguard.worker.generate.loop import GenerationLoop
from vramguard.worker.health.hang import ForwardTimeout, HangGuard, exit_now, measure_seconds_per_cost
from vramguard.worker.health.heartbeat import Heartbeat, WorkerStats
from vramguard.worker.health.watchdog import Watchdog
from vramguard.worker.memory.budget import MemoryBudget, MemoryPlanError, start_budget
from vramguard.worker.memory.ledger import PlacementError
from vramguard.worker.memory.oom import CudaContextLost
from vramguard.worker.metrics import WorkerMetrics
from vramguard.worker.models import BackendContractError, check_output
from vramguard.worker.modelthreads import ModelThreads
from vramguard.worker.tasks import LONG_LIVED, LoopRecovery

log = logging.getLogger(__name__)


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
        generates = bool(settings.spec_for(settings.model).options.get("generates"))
        self.metrics = WorkerMetrics(backend.device, generates=generates)
        self.hang = HangGuard(self._hung)
        self.primary_watch = PrimaryWatch(settings)  # under Sentinel: follows a failover at once (shared/failover.py)
        self.tasks = TaskWatch(self._task_ended)  # heartbeat, reclaim, clock sync, hang guard
        self.threads = ModelThreads(self.config.max_inflight_batches)  # every call into the backend
        self.watchdog = Watchdog(settings, backend, self._unhealthy, threads=self.threads, hang=self.hang)
        self._decode_s_per_item = 0.0  # decoding the example inputs, measured at warmup (worker/health/hang.py)
        self.budget: MemoryBudget | None = None  # measured in warm_up (worker/memory/budget.py)
        self.fatal: ExitCode | None = None  # set when the device context is lost
        self.start_error: str | None = None  # why the start failed (worker/health/startfail.py reports it)
        self.batch_task_failures = 0  # batch tasks that raised (worker/batch/batch_errors.py)
        # Entries of batches being served (kept fresh by reclaim), counted: with concurrent
        # batches two slices of one large entry may be in flight at once.
        self._held: Counter[EntryId] = Counter()
        self.ledger = PackLedger()  # packs read by the batcher, acked by the batch server (worker/batch/entries.py)
        self._batcher: Batcher | None = None
        self.reclaimer: Reclaimer | None = None
        self._server: BatchServer | None = None  # built after warmup, when the memory budget is known
        self.generation: GenerationLoop | None = None  # a generative model's loop, instead of batches

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
        """First signal: drain. Second: force (uvicorn's two-step shutdown); at once while a
        forward runs, since its thread cannot be interrupted (worker/health/hang.py)."""
        if self.should_exit:
            self.force_exit = True
            if self.hang.forward_running:
                exit_now(ExitCode.FORCED, "second signal during a forward; exiting at once",
                         signal=signal.Signals(sig).name, worker_id=self.worker_id)
        self.should_exit = True
        log.info("signal received", extra={"signal": signal.Signals(sig).name, "force": self.force_exit})

    async def run(self) -> ExitCode:
        """Run until a signal or `max_batches`; returns the exit code for `sys.exit`."""
        redis = connect(self.settings, retry_timeouts=True)
        blocking = connect_blocking(self.settings)
        self.primary_watch.start([redis, blocking])
        try:
            code = await self._run(redis, blocking)
            return self.fatal or code  # a lost device context outranks a clean drain
        finally:
            self.threads.close()
            await self.primary_watch.stop()
            await close(blocking)
            await close(redis)

    async def _run(self, redis: aioredis.Redis, blocking: aioredis.Redis) -> ExitCode:
        reclaimer = self.reclaimer = Reclaimer(
            self.settings, redis, self.stream, self.keys.dead_letter_stream(self.settings.model), self.worker_id,
            self.held_entries,
        )
        clock = ClockSync(redis)
        try:
            await self.ensure_group(redis)
            await clock.start()  # deadlines and heartbeats on Redis' clock (shared/clock.py)
            self.stats.started_ms = now_ms()
            await check_eviction_policy(redis, self.settings)
            await self.threads.run(self.warm_up)
            await reclaimer.load_own_pending()  # a restart under a stable name: re-deliver these first
        # PlacementError and MemoryPlanError are RuntimeErrors as well, so they come before the
        # Redis branch (whose RuntimeError is an evicting Redis under eviction_check=refuse).
        except PlacementError as exc:
            await clock.stop()
            log.error("memory share refused: the GPU is already fully shared", extra={"error": str(exc)})
            self.start_error = "memory share refused: the GPU is already fully shared" + f": {exc}"
            return ExitCode.STARTUP_FAILED
        except (MemoryPlanError, CudaContextLost) as exc:  # the warmup itself may not fit
            await clock.stop()
            log.error("memory budget too small or device failed at start", extra={"error": str(exc)})
            self.start_error = "memory budget too small or device failed at start" + f": {exc}"
            return ExitCode.STARTUP_FAILED
        except (RedisError, RuntimeError) as exc:
            await clock.stop()
            log.error("cannot use Redis at start", extra={"error": str(exc)})
            self.start_error = "cannot use Redis at start" + f": {exc}"
            return ExitCode.STARTUP_FAILED
        except BackendContractError as exc:
            log.error("model does not follow its declared contract", extra={"error": str(exc)})
            self.start_error = "model does not follow its declared contract" + f": {exc}"
            return ExitCode.MODEL_INVALID
        except UnavailableError as exc:  # an engine the model calls is down: a restart may find it up
            log.error("a service the model needs is unavailable at start", extra={"error": exc.message})
            self.start_error = "a service the model needs is unavailable at start" + f": {exc.message}"
            return ExitCode.STARTUP_FAILED
        budget = self.budget
        assert budget is not None
        self.watchdog.guard = budget.exclusive  # probes wait for the device to be theirs
        self._server = BatchServer(
            self.settings, self.backend, self.worker_id, stats=self.stats, metrics=self.metrics,
            watchdog=self.watchdog, budget=budget, on_context_lost=self._context_lost, threads=self.threads,
            hang=self.hang, ledger=self.ledger,
        )
        if self.settings.spec_for(self.settings.model).options.get("generates"):
            log.info("measuring the KV cache", extra={"model": self.settings.model})
            self.generation = await GenerationLoop.start(self, budget, redis)
        heartbeat = Heartbeat(self.settings, redis, self.keys, self.beat)
        self.watchdog.mark_ok()  # the warmup was the first probe
        self.stats.state = "ready"
        heartbeat.start()
        reclaimer.start()
        self.hang.start()
        self.tasks.watch_running(LONG_LIVED)
        log.info("worker ready", extra={"worker_id": self.worker_id, "model": self.settings.model,
                                        "device": self.backend.device,
                                        "full_batch_forward_timeout_s": self.hang.limit_s,
                                        "event_loop_module": type(asyncio.get_running_loop()).__module__,
                                        "settings": self.settings.masked()})
        try:
            if self.generation is not None:
                return await self.generation.serve(redis, blocking)
            await self._serve_forever(redis, blocking)
            if self.watchdog.unhealthy_reason is not None:
                return ExitCode.UNHEALTHY  # no drain: never reply from a device we no longer trust
            self.stats.state = "draining"
            return await self._drain(redis)
        finally:
            self.tasks.stop()
            for stop in (clock.stop, self.hang.stop, reclaimer.stop, heartbeat.stop):
                # A task that already ended (the watch reported it) re-raises its end on stop():
                # gather keeps that from skipping the other steps, yet lets our own cancellation through.
                (outcome,) = await asyncio.gather(stop(), return_exceptions=True)
                if isinstance(outcome, BaseException):
                    log.debug("stopping a task that had ended", extra={"error": repr(outcome)})

    async def ensure_group(self, redis: aioredis.Redis) -> None:
        """Create the request stream and the `workers` group if missing (a fresh or restarted Redis)."""
        try:
            await redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def warm_up(self) -> None:
        """Load the weights, run the example inputs once, then measure and plan the memory budget
        (blocking; call in a thread). Raises MemoryPlanError when the budget cannot hold one item."""
        started = monotonic_ms()
        # Each step of the start is logged as it begins: `vramguard up` shows them while it waits
        # (vramguard/cli/readiness.py), and a start of a minute says where the minute goes.
        log.info("loading the weights", extra={"model": self.settings.model})
        measured = iter(range(1, 1 << 30))
        self.budget = start_budget(self.backend, self.settings, self.config, warm_up=self._run_examples,
                                   on_step=lambda: log.info("measured the memory of a batch size",
                                                            extra={"step": next(measured)}))
        self._set_timeouts()
        log.info("warmup done", extra={"duration_ms": round(monotonic_ms() - started, 1)})
        plan = self.budget.plan
        log.info("memory plan", extra={"model": self.settings.model, "worker_id": self.worker_id,
                                       "gpu": self.settings.cuda_visible_devices, **plan.as_dict()})
        if plan.inflight_batches < self.config.max_inflight_batches:
            log.warning("the memory budget holds fewer concurrent forwards than max_inflight_batches; "
                        "running that many", extra={"max_inflight_batches": self.config.max_inflight_batches,
                                                    "inflight_batches": plan.inflight_batches})

    def _set_timeouts(self) -> None:
        """Each forward's and decode's timeout (worker/health/hang.py): configured, or scaled from a forward
        of full-window items measured now, after the memory plan: the longest items the budget runs,
        as many (up to 2) as fit one forward, so the measurement never meets out of memory."""
        configured, window = self.config.forward_timeout_s, self.backend.max_item_cost
        limit = self.budget.max_batch_cost if self.budget is not None else None
        cost = min(window, limit) if limit is not None else window
        n_items = min(2, self.config.max_batch_size, limit // cost if limit is not None else 2)
        if hasattr(self.backend, "forward_step"):  # a generative step is one packed row of at most `window` tokens
            n_items = 1
        per_cost = 0.0 if configured is not None else measure_seconds_per_cost(
            cost, n_items, lambda n: self._run_sample(cost, n))
        self.hang.timeout = ForwardTimeout(configured, per_cost, self._decode_s_per_item)
        self.hang.limit_s = self.hang.timeout.for_cost(self.config.max_batch_size * window)

    def _run_sample(self, cost: int, n_items: int) -> None:
        run_batch(self.backend, [self.backend.sample_item(cost) for _ in range(n_items)], self.config.max_batch_size,
                  budget=self.budget)

    def _run_examples(self) -> None:
        """The warmup batch. Raises BackendContractError when the model fails its own example inputs
        or returns what it does not declare, UnavailableError when an engine it calls is down. Its
        decode time feeds the derived decode timeout (worker/health/hang.py)."""
        model = self.settings.model
        log.info("warm-up: the model's example inputs", extra={"model": model})
        started = monotonic_ms()
        try:
            items = self.backend.decode(self.backend.example_inputs(), {})
        except Exception as exc:
            raise BackendContractError(f"model {model!r}: decode(example_inputs()) raised {exc!r}") from exc
        decode_s = (monotonic_ms() - started) / 1000 / max(1, len(items))
        self._decode_s_per_item = max(self._decode_s_per_item, decode_s)  # the decode timeout scales the slowest
        results, _ = run_batch(self.backend, items, self.config.max_batch_size)
        failed = next((r for r in results if not r.ok), None)
        if failed is not None and failed.error_code == UnavailableError.code:
            raise UnavailableError(f"warmup: {failed.error_message}")
        if failed is not None:
            raise BackendContractError(f"model {model!r}: the warmup batch failed: {failed.error_message}")
        for result in results:
            check_output(self.settings.spec_for(model), result.output)

    async def _serve_forever(self, redis: aioredis.Redis, blocking: aioredis.Redis) -> None:
        batcher = Batcher(
            blocking, self.stream, self.worker_id,
            max_batch_size=self.config.max_batch_size, max_wait_ms=self.config.max_wait_ms,
            block_ms=self.settings.block_ms, replay_history=False, ledger=self.ledger,
            requests_per_entry=self.config.requests_per_entry,
        )
        self._batcher = batcher
        # Concurrent forwards: the configured max_inflight_batches, or fewer when the memory plan
        # holds fewer (worker/memory/plan.py gives each of them its own room in the budget).
        inflight = self.budget.plan.inflight_batches if self.budget is not None else self.config.max_inflight_batches
        slots = asyncio.Semaphore(min(self.config.max_inflight_batches, inflight))
        recovery, read = LoopRecovery(self.primary_watch.pause), 0
        while not self.should_exit and (self._max_batches is None or read < self._max_batches):
            if self.reclaimer is not None and self.reclaimer.has_work:
                try:
                    await self._serve_suspect(redis, self.reclaimer)
                    recovery.succeeded()
                except Exception as exc:  # noqa: BLE001 - any Redis trouble, also replies redis-py cannot parse
                    await self._recover(redis, exc, recovery, "reclaim")
                continue
            await slots.acquire()
            if self.should_exit:  # signalled while waiting for a slot: read nothing more
                slots.release()
                break
            if self.budget is not None:  # the adaptive cap (worker/memory/budget.py) bounds what is read
                batcher.max_batch_size = min(self.config.max_batch_size, self.budget.max_batch_size)
            try:
                entries = await batcher.read_batch()
                recovery.succeeded()
            except Exception as exc:  # noqa: BLE001 - any Redis trouble, also replies redis-py cannot parse
                slots.release()
                await self._recover(blocking, exc, recovery, "read")
                continue
            if not entries:
                slots.release()
                if not self._inflight and self.watchdog.probe_due:
                    await self.watchdog.probe()
                continue
            read += 1
            if entries[0].entry.delivery_count > 1:  # a suspect (batcher.py): nothing else in flight with it
                try:
                    with self._holding(entries):  # kept fresh while the batches in flight end
                        if self._inflight:
                            await asyncio.wait(set(self._inflight))
                        assert self.reclaimer is not None
                        await self._serve_alone(redis, self.reclaimer, entries)
                except Exception as exc:  # noqa: BLE001 - Redis trouble: the entry stays pending for reclaim
                    await self._recover(redis, exc, recovery, "suspect")
                finally:
                    slots.release()
                continue
            task = asyncio.create_task(self._serve_batch(redis, entries))
            self._inflight.add(task)
            task.add_done_callback(lambda t: self._batch_done(t, slots))

    def _batch_done(self, task: asyncio.Task[None], slots: asyncio.Semaphore) -> None:
        self._inflight.discard(task)
        slots.release()

    async def _recover(self, client: aioredis.Redis, exc: Exception, recovery: LoopRecovery, what: str) -> None:
        """After a failed Redis call of the batch loop: recreate the group of a Redis that restarted
        empty, else back off (and reconnect after an unparsable reply); exit when that never ends."""
        if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
            try:
                await self.ensure_group(client)  # Redis restarted empty
                return
            except RedisError:
                pass
        if not await recovery.failed(what, exc, client):
            self._task_ended(f"the batch loop's {what} failed {recovery.unexpected} times in a row "
                             f"with replies redis-py could not read; last: {exc!r}")

    def held_entries(self) -> list[EntryId]:
        """Stream entries this worker holds: batches being served and the batcher's carry-over
        (a pack once, for all its requests held)."""
        carried = self._batcher.carried_ids if self._batcher is not None else []
        generating = self.generation.server.held_ids() if self.generation is not None else []
        return stream_ids([*self._held, *carried, *generating])

    async def _serve_suspect(self, redis: aioredis.Redis, reclaimer: Reclaimer) -> None:
        """Serve one reclaimed entry alone, with no other batch in flight, so that if it is the
        input that kills workers it takes nothing else with it; past max_deliveries, dead-letter it."""
        if self._inflight:
            await asyncio.wait(set(self._inflight))
        suspect = await reclaimer.claim_one()
        if suspect is None:
            return
        await self._serve_alone(redis, reclaimer, [Slice.whole(suspect.entry)])

    async def _serve_alone(self, redis: aioredis.Redis, reclaimer: Reclaimer, batch: list[Slice]) -> None:
        """Serve a suspect's batch of one (nothing else in flight), or dead-letter it once it has
        used up max_deliveries (Reclaimer.may_run)."""
        entry = batch[0].entry
        if not await reclaimer.may_run(entry):
            await reclaimer.dead_letter(Suspect(entry, entry.delivery_count), self.settings.reply_stream_maxlen)
            return
        await self._serve_batch(redis, batch)

    async def _drain(self, redis: aioredis.Redis) -> ExitCode:
        carried = self._batcher.drain_carry() if self._batcher is not None else []
        with self._holding(carried):  # kept fresh while they wait for the batches in flight
            return await self._drain_carried(redis, carried)

    async def _drain_carried(self, redis: aioredis.Redis, carried: list[Slice]) -> ExitCode:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.settings.shutdown_grace_s
        if carried and self._inflight:  # one batch at a time, as while serving (memory budget)
            await asyncio.wait(set(self._inflight), timeout=self.settings.shutdown_grace_s)
        if carried and not self._inflight and not self.force_exit:  # entries read but not yet served
            task = asyncio.create_task(self._serve_batch(redis, carried))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        if not self._inflight:
            return ExitCode.OK
        done, pending = await asyncio.wait(set(self._inflight), timeout=max(0.0, until - loop.time()))
        if pending or self.force_exit:
            log.warning("grace period over; leaving batches for reclaim", extra={"batches": len(pending)})
            return ExitCode.FORCED
        return ExitCode.OK

    @contextmanager
    def _holding(self, batch: list[Slice]) -> Iterator[None]:
        """Count `batch`'s entries as held while the block runs: reclaim keeps their idle time
        fresh (held_entries), so no other worker takes them meanwhile."""
        ids = [part.entry_id for part in batch]
        self._held.update(ids)
        try:
            yield
        finally:
            self._held.subtract(ids)
            self._held = +self._held  # drop the entries no batch holds any more

    async def _serve_batch(self, redis: aioredis.Redis, batch: list[Slice]) -> None:
        """Serve one batch while its entries count as held (their idle time kept fresh by reclaim)."""
        assert self._server is not None
        with self._holding(batch):
            try:
                await self._server.serve(redis, batch)
            except Exception as exc:  # noqa: BLE001 - a bug in our own code: answer now, never lose it
                self.batch_task_failures += 1
                for part in batch:  # answered below: later slices of a large entry are dropped
                    part.held.closed = True
                await answer_internal_error(
                    redis, stream=self.stream, dead_letter_stream=self.keys.dead_letter_stream(self.settings.model),
                    queued_requests=self.keys.queued_requests(self.settings.model), worker_id=self.worker_id,
                    entries=list({p.entry_id: p.entry for p in batch}.values()), exc=exc,
                    reply_maxlen=self.settings.reply_stream_maxlen, ledger=self.ledger)

    def _context_lost(self) -> None:
        """A forward lost the device context: stop at once and exit CUDA_CONTEXT_LOST, un-acked."""
        self.fatal = ExitCode.CUDA_CONTEXT_LOST
        self.should_exit = self.force_exit = True

    def _task_ended(self, reason: str) -> None:
        """A long-lived task ended (worker/tasks.py): stop reading, drain, exit TASK_ENDED for a restart."""
        log.critical("worker cannot go on; exiting for a restart", extra={"worker_id": self.worker_id,
                                                                          "reason": reason})
        self.fatal = self.fatal or ExitCode.TASK_ENDED
        self.should_exit = True

    def _hung(self, running_s: float, what: str, request_ids: Sequence[str], limit_s: float) -> None:
        """A forward or a decode ran past its timeout: report it and leave at once, un-acked."""
        exit_now(ExitCode.FORWARD_HUNG, f"{'decode' if what == 'decode' else 'forward'} hung; exiting for a restart",
                 worker_id=self.worker_id, model=self.settings.model, forward=what, running_s=round(running_s, 1),
                 timeout_s=round(limit_s, 2), request_ids=list(request_ids))

    def _unhealthy(self, reason: str) -> None:
        """The watchdog's verdict: report unhealthy, stop reading, exit ExitCode.UNHEALTHY."""
        self.stats.state = "unhealthy"
        self.should_exit = True
        log.error("worker unhealthy; exiting for a restart", extra={"worker_id": self.worker_id, "reason": reason})

    def beat(self) -> WorkerBeat:
        """This worker's heartbeat record now: identity and placement, configured batching, the
        counters, the watchdog, the metrics and the memory budget."""
        parts: dict[str, Any] = {
            **asdict(self.stats), **self.watchdog.heartbeat_fields(), "batch_task_failures": self.batch_task_failures,
            "reclaimed": self.reclaimer.claimed if self.reclaimer else 0,
            "dead_lettered": self.reclaimer.dead_lettered if self.reclaimer else 0,
            **self.metrics.heartbeat_fields(self.stats.items, self.stats.batches),
            **(self.budget.heartbeat_fields() if self.budget is not None else {}),
            "generation": self.generation.server.heartbeat_field() if self.generation is not None else "",
        }
        if self.generation is not None:  # its cap is the generation's rows, not the batch plan's items
            parts["adaptive_batch_cap"] = self.generation.server.row_cap
        return WorkerBeat(
            worker_id=self.worker_id, model=self.settings.model, pid=os.getpid(), host=socket.gethostname(),
            device=self.backend.device, gpu=self.settings.cuda_visible_devices or "",
            max_batch_size=self.config.max_batch_size, max_wait_ms=self.config.max_wait_ms,
            max_inflight_batches=self.config.max_inflight_batches, **parts,  # a misnamed part raises TypeError here
        )


__all__ = ["ExitCode", "Worker"]
