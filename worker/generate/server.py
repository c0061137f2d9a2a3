"""The serve loop of a generative model (the worker runs it instead of the batch loop): read as
many requests from the model's stream as the KV pool can admit now, queue them for the engine
(which admits them at step boundaries, worker/generate/engine.py), run steps on the model thread,
and after each step write progress, then chunks, then ack what finished
(worker/generate/progress.py). Requests the pool cannot take yet stay in the stream (unread),
where an idle worker may take them.

Entries of dead workers come back through worker/batch/reclaim.py; their progress in Redis lets this
worker resume their sequences where the client's stream stands. A chunk whose publish fails is
sent again (docs/concepts/streams.md): a running sequence's next chunk starts where the failed
one did, a finished one's last chunk is re-sent each round until it goes out. A sequence whose
entry another worker claimed (it stalled past claim_idle_ms) stops at its next progress write.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.clock import monotonic_ms, now_ms
from vramguard.shared.errors import DeadlineExceededError, InputTooLargeError, InvalidInputError, ModelError
from vramguard.shared.keys import Keys
from vramguard.shared.protocol import EntryId, ReplyMessage
from vramguard.shared.settings import Settings
from vramguard.worker.batch.entries import Entry
from vramguard.worker.batch.execute import is_oom
from vramguard.worker.batch.publish import DeadLetter, Outgoing, publish_replies
from vramguard.worker.generate.engine import Emitted, Engine
from vramguard.worker.generate.intake import Intake
from vramguard.worker.generate.kvplan import KVPlan
from vramguard.worker.generate.kvpool import KVPool
from vramguard.worker.generate.oom import RowCap, undo_step
from vramguard.worker.generate.progress import cancelled as cancel_flags
from vramguard.worker.generate.progress import chunk_reply, read_progress, write_progress
from vramguard.worker.generate.sampling import SamplingParams
from vramguard.worker.generate.sequence import Sequence
from vramguard.worker.generate.window import completion_bound
from vramguard.worker.health.hang import HangGuard
from vramguard.worker.health.heartbeat import WorkerStats
from vramguard.worker.health.watchdog import Watchdog
from vramguard.worker.metrics import WorkerMetrics
from vramguard.worker.modelthreads import ModelThreads

log = logging.getLogger(__name__)

DEFAULT_CHUNK_MS = 20.0  # a running sequence's tokens are sent at most this often (its first at once)


@dataclass(slots=True)
class GenerationStats:
    """Counters for the heartbeat (`WorkerBeat.generation`, JSON) and the gateway's /metrics."""

    running: int = 0
    waiting: int = 0
    finished: int = 0
    cancelled: int = 0
    resumed: int = 0
    lost: int = 0  # stopped because another worker claimed their entry (this one stalled past claim_idle_ms)
    failed: int = 0
    tokens_generated: int = 0
    steps: int = 0
    kv_bytes_used: int = 0  # tokens the sequences hold x bytes per token
    kv_bytes_reserved: int = 0  # blocks the sequences hold x block bytes (a shared block once)
    kv_bytes_peak: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_shared: int = 0
    kv_tokens_held: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    first_token_steps_last: int = 0  # steps from reading a request to its first token, the latest one
    first_token_steps_max: int = 0
    ttft_ms_sum: float = 0.0
    ttft_count: int = 0
    tpot_ms_sum: float = 0.0  # time per output token after the first, summed over finished sequences
    tpot_count: int = 0


class GenerationServer:
    """Continuous batching for `settings.model` as consumer `worker_id`, inside `plan`."""

    def __init__(self, settings: Settings, backend: Any, worker_id: str, *, plan: KVPlan, pool: KVPool,
                 threads: ModelThreads, on_oom: Callable[[int], None] | None = None,
                 metrics: WorkerMetrics | None = None, hang: HangGuard | None = None,
                 worker_stats: WorkerStats | None = None, watchdog: Watchdog | None = None) -> None:
        self._settings = settings
        self._backend = backend
        self.worker_id = worker_id
        self.plan = plan
        self._threads = threads
        self._keys = Keys(settings.key_prefix)
        self._model = settings.model
        self._stream = self._keys.request_stream(settings.model)
        self._pool = pool
        self._engine = Engine(backend, pool, plan.token_budget, plan.max_running)
        config = settings.model_config_for(settings.model)
        self._chunk_ms = float(config.params.get("chunk_ms", DEFAULT_CHUNK_MS))
        self._intake = Intake(self._stream, worker_id, config.max_wait_ms)
        self.stats = GenerationStats()
        # The counters every worker reports (vramguard_worker_*), in a generation's terms: a batch is a
        # step, an item a token generated, a request a finished sequence (docs/reference/metrics.md).
        self._worker_stats = worker_stats or WorkerStats()
        self._watchdog = watchdog  # probes the device after a failed step (worker/health/watchdog.py)
        self._rows = RowCap(plan.max_running, plan.token_budget)  # lowered by an OOM inside a step (oom.py)
        self._on_oom = on_oom  # the memory budget's: counts the event and frees the allocator's cache
        self._metrics = metrics or WorkerMetrics("cpu", generates=True)  # the histograms the heartbeat carries
        self._hang = hang or HangGuard(lambda *_: None)  # the runner's guard ends a step that never returns
        self._unsent: list[Emitted] = []  # finished sequences whose last chunk's publish failed: re-sent

    # --- what the runner asks -------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._engine.running or self._engine.waiting or self._unsent)

    def held_ids(self) -> list[EntryId]:
        """Entries being generated or waiting here (kept from looking dead by reclaim)."""
        return [s.entry_id for s in (*self._sequences(), *(e.seq for e in self._unsent))]

    @property
    def row_cap(self) -> int:
        """The most sequences a step may run now: the KV plan's max_running, halved by each OOM
        inside a step and grown back (oom.py's RowCap); the heartbeat's `adaptive_batch_cap`."""
        return self._rows.value

    def heartbeat_field(self) -> str:
        self._note_pool()  # after leaves too, not only after steps
        return json.dumps({"kv_plan": self.plan.as_dict(), **asdict(self.stats)})

    def _note_pool(self) -> None:
        """The pool's counters into stats (running, waiting, blocks, tokens held, prefix sharing)."""
        stats, pool, engine = self.stats, self._pool, self._engine
        stats.running, stats.waiting = len(engine.running), len(engine.waiting)
        self._intake.note_running(stats.running)
        stats.kv_blocks_total, stats.kv_blocks_used = pool.num_blocks, pool.held_blocks()
        stats.kv_blocks_shared = pool.shared_blocks()
        stats.kv_tokens_held = engine.tokens_held()
        stats.kv_bytes_used = stats.kv_tokens_held * self.plan.bytes_per_token
        stats.kv_bytes_reserved = stats.kv_blocks_used * self.plan.block_tokens * self.plan.bytes_per_token
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, stats.kv_bytes_reserved)
        stats.preemptions, stats.prefix_hits, stats.prefix_hit_tokens = (
            engine.preemptions, pool.prefix_hits, pool.prefix_hit_tokens)

    def _sequences(self) -> list[Sequence]:
        return self._engine.sequences()

    # --- intake ---------------------------------------------------------------------------

    def room(self) -> int:
        """How many entries to read now: as many as the pool can admit (none while one waits for
        blocks; the rest stay in the stream, where an idle worker may take them)."""
        return self._engine.room(self._rows.value)

    async def read(self, redis: aioredis.Redis, block_ms: int | None) -> list[Entry]:
        """Up to room() new entries (intake.py; block_ms None: the worker is busy, do not block; else
        block, then hold the admission window). Raises RedisError."""
        return await self._intake.read(redis, self.room(), block_ms)

    async def take(self, redis: aioredis.Redis, entries: list[Entry]) -> None:
        """Turn entries into sequences (resuming those with progress in Redis) or answer them at once."""
        for entry in entries:
            try:
                seq = await self._sequence(redis, entry)
            except (InvalidInputError, InputTooLargeError, DeadlineExceededError) as exc:
                await self._refuse(redis, entry, exc.code, exc.message)
                continue
            except RedisError:
                raise
            except Exception as exc:  # noqa: BLE001 - the model's tokenizer failed on this input: 500, not a dead worker
                log.exception("prompt failed", extra={"entry_id": entry.entry_id})
                await self._refuse(redis, entry, ModelError.code, f"the prompt failed: {type(exc).__name__}: {exc}")
                continue
            if seq is not None and seq.finish_reason is not None:  # it ended; its last chunk may be unsent
                full = await self._threads.run(self._backend.detokenize, seq.generated)
                seq.chunk -= 1
                text, seq.text_sent = full[seq.text_before : seq.text_sent], seq.text_before
                await self._publish(redis, [Emitted(seq, text)])
            elif seq is not None:
                seq.read_step = self.stats.steps
                self._engine.add(seq)
                self._note_queued(entry)

    def _note_queued(self, entry: Entry) -> None:
        """A new sequence's queue delay: from its enqueue to its read here (a reclaimed one's since
        its first enqueue), as the batch path records a request's."""
        assert entry.message is not None
        delay_ms = float(now_ms() - entry.message.enqueued_ms)
        self._worker_stats.queue_delay_ms_sum += delay_ms
        self._metrics.observe_batch(0, (delay_ms,), None)

    async def _sequence(self, redis: aioredis.Redis, entry: Entry) -> Sequence | None:
        msg = entry.message
        if msg is None:
            await self._finish(redis, [], [entry.entry_id], [DeadLetter(entry.entry_id, entry.fields,
                                                                         entry.decode_error or "undecodable")])
            return None
        if msg.deadline_ms <= now_ms():
            raise DeadlineExceededError("deadline passed before the sequence started")
        params = msg.parameters
        prompt = await self._threads.run(self._backend.prompt_ids, msg.inputs[0] if msg.inputs else None, params)
        given = params.get("max_tokens")
        max_tokens = completion_bound(len(prompt), None if given is None else int(cast(int, given)),
                                      self.plan.context_window, self.plan.tokens_fit,
                                      chat=bool(msg.inputs) and isinstance(msg.inputs[0], list))
        if not self.plan.fits_alone(len(prompt) + max_tokens):
            raise InputTooLargeError(f"prompt + max_tokens = {len(prompt) + max_tokens} tokens; the KV pool "
                                     f"holds {self.plan.tokens_fit} tokens")
        seed = params.get("seed")
        seq = Sequence(request_id=msg.request_id, entry_id=entry.entry_id, reply_to=msg.reply_to,
                       deadline_ms=msg.deadline_ms, prompt_ids=prompt, max_tokens=max_tokens,
                       sampling=SamplingParams(float(cast(float, params.get("temperature", 1.0))),
                                               float(cast(float, params.get("top_p", 1.0))),
                                               int(cast(int, seed)) if seed is not None else random.getrandbits(63)),
                       stop=tuple(str(s) for s in cast(list[object], params.get("stop", []))))
        await self._resume(redis, seq)
        return seq

    async def _resume(self, redis: aioredis.Redis, seq: Sequence) -> None:
        """Take a dead worker's progress for `seq`: its tokens, last chunk and seed."""
        progress = await read_progress(redis, self._keys, self._model, seq.request_id)
        if progress is None:
            return
        seq.generated = list(progress.tokens)
        seq.chunk, seq.text_before, seq.text_sent = progress.chunk, progress.text_before, progress.text_sent
        seq.sampling = SamplingParams(seq.sampling.temperature, seq.sampling.top_p, progress.seed)
        seq.finish_reason = progress.finish_reason
        seq.resumed = True
        self.stats.resumed += 1
        log.info("sequence resumed", extra={"request_id": seq.request_id, "tokens": len(seq.generated),
                                            "chunk": seq.chunk})

    # --- a step ---------------------------------------------------------------------------

    async def step(self, redis: aioredis.Redis) -> None:
        """Drop cancelled and expired sequences, resend what resumed ones owe, run one step, publish."""
        try:
            await self._step(redis)
        finally:
            self._note_pool()

    async def _step(self, redis: aioredis.Redis) -> None:
        await self._drop_gone(redis)
        if self._unsent:  # finished sequences whose last chunk did not go out: again, before anything new
            unsent, self._unsent = self._unsent, []
            await self._send(redis, unsent)
        # Published alone, before this step's text is cut: that text starts where the re-sent chunk ends.
        if any(s.resumed for s in self._engine.sequences()):  # a thread hop only when one is owed
            await self._publish(redis, await self._threads.run(self._resend))
        if self._engine.running or self._engine.waiting:
            ids = [s.request_id for s in self._engine.sequences()]
            forwards, tokens, started = self._engine.forwards, self.stats.tokens_generated, monotonic_ms()
            try:
                # Timed as a forward is (worker/health/hang.py): a step that never returns ends the
                # process, and its sequences are reclaimed and resumed from their progress elsewhere.
                with self._hang.forward("step", ids):
                    emitted = await self._threads.run(self._compute_or_oom)
            except Exception as exc:  # noqa: BLE001 - the model failed: the device, or these sequences?
                self._count_step(forwards, tokens, started, done=False)
                log.exception("generation step failed", extra={"error": str(exc)})
                if not await self._device_answers():
                    return  # never answer from a broken device: the worker exits, the sequences resume elsewhere
                await self._fail_all(redis, f"generation failed: {type(exc).__name__}: {exc}")
                return
            self._count_step(forwards, tokens, started, done=emitted is not None)
            if emitted is None:
                await self._after_oom(redis)
                return
        else:
            emitted = []
        await self._publish(redis, emitted)

    async def _device_answers(self) -> bool:
        """After a failed step, the watchdog's probe on its known-good input: passing, the step's
        sequences were at fault (they get 500); failing (a sticky CUDA error fails every launch), the
        watchdog marks the worker unhealthy and it exits with their entries pending and their progress
        written, for a live worker to reclaim and resume, as after a crash."""
        if self._watchdog is None:
            return True
        await self._watchdog.probe(context="after a generation step failed")
        return self._watchdog.unhealthy_reason is None

    def _count_step(self, forwards: int, tokens: int, started_ms: float, *, done: bool) -> None:
        """A step in the worker's counters, given the engine's forwards and the tokens generated
        before it and its start (monotonic ms): each forward it ran (one that failed or ran out of
        memory too); when it ran to its end, a batch whose items are the tokens it generated, timed
        from before the thread hop as the batch path times a batch's forwards."""
        ran = self._engine.forwards - forwards
        if not done or not ran:
            self._worker_stats.forwards += ran
            return
        items = self.stats.tokens_generated - tokens
        self._worker_stats.record_batch(items, 0, ran, 0)
        self._metrics.observe_batch(items, (), monotonic_ms() - started_ms)

    def _count_failed(self, sequences: int) -> None:
        """Sequences answered with an error: the generation's `failed` and the worker's `errors`."""
        self.stats.failed += sequences
        self._worker_stats.errors += sequences

    def _compute_or_oom(self) -> list[Emitted] | None:
        """A step, or None when it ran out of memory (the exception, and the tensors its traceback
        holds, do not outlive the except block: PyTorch FAQ, as in worker/batch/execute.py)."""
        try:
            emitted = self._compute()
        except Exception as exc:
            if not is_oom(exc):
                raise
            return None
        self._rows.on_step()
        return emitted

    async def _after_oom(self, redis: aioredis.Redis) -> None:
        """Undo the step, free its blocks, halve the caps and queue its sequences to run again in fewer
        rows and tokens; one that ran out of memory alone in a one-token step ends with its own error
        (413), as in the batch path."""
        tokens = self._rows.tokens
        seqs = await self._threads.run(undo_step, self._engine)
        self._rows.on_oom(len(seqs))
        if self._on_oom is not None:
            await self._threads.run(self._on_oom, len(seqs))
        log.warning("out of memory in a generation step; cache freed, sequences run again in fewer rows",
                    extra={"sequences": len(seqs), "max_rows": self._rows.value})
        if len(seqs) != 1 or tokens > 1:
            return  # queued again, at the head, for fewer rows and tokens
        self._count_failed(1)
        seq = seqs[0]
        self._engine.remove({id(seq)})
        reply = ReplyMessage.failure(seq.request_id, InputTooLargeError.code,
                                     f"the sequence ({len(seq.context_ids)} tokens) does not fit the worker's "
                                     "memory budget even alone", worker_id=self.worker_id)
        await self._finish(redis, [Outgoing(seq.reply_to, reply)], [seq.entry_id], [], progress_of=[seq])

    def _compute(self) -> list[Emitted]:
        self._engine.max_running, self._engine.token_budget = self._rows.value, self._rows.tokens
        advanced = self._engine.step()
        self.stats.steps += 1
        self.stats.tokens_generated += len(advanced)
        self._note_pool()
        now = monotonic_ms()
        due = [s for s in advanced if s.chunk == 0 or now - s.last_chunk_ms >= self._chunk_ms
               or len(s.generated) >= s.max_tokens or s.generated[-1] in self._backend.eos_token_ids]
        return self._engine.texts(due, self._backend.eos_token_ids)

    def _resend(self) -> list[Emitted]:
        """A resumed sequence's last chunk, once: the client may not have it (the gateway drops it if so)."""
        out = []
        for seq in self._engine.sequences():
            if seq.resumed and seq.chunk > 0:
                seq.resumed = False
                full = self._backend.detokenize(seq.generated)
                seq.chunk -= 1  # _publish numbers it again
                out.append(Emitted(seq, full[seq.text_before : seq.text_sent]))
                seq.text_sent = seq.text_before
        return out

    async def _publish(self, redis: aioredis.Redis, emitted: list[Emitted]) -> None:
        """Number the emitted chunks, then send them (_send)."""
        if not emitted:
            return
        now = monotonic_ms()
        for e in emitted:
            e.seq.chunk += 1
            e.seq.text_before, e.seq.text_sent = e.seq.text_sent, e.seq.text_sent + len(e.text)
            e.seq.last_chunk_ms = now
            if e.seq.first_token_ms is None:
                e.seq.first_token_ms = now
                steps = self.stats.steps - e.seq.read_step
                self.stats.first_token_steps_last = steps
                self.stats.first_token_steps_max = max(self.stats.first_token_steps_max, steps)
                self.stats.ttft_count += 1
                self.stats.ttft_ms_sum += now - e.seq.started_ms
                self._metrics.observe_first_token(now - e.seq.started_ms)
        await self._send(redis, emitted)

    async def _send(self, redis: aioredis.Redis, emitted: list[Emitted]) -> None:
        """Progress (fenced: only for entries this worker still owns), then chunks, then the acks
        of finished sequences (progress.py's order). A sequence whose entry was claimed by another
        worker stops here, unsent; when a write fails, what it carried is sent again (_not_sent).
        Raises RedisError when the progress write failed (the loop backs off)."""
        try:
            lost = await write_progress(redis, self._keys, self._model, [e.seq for e in emitted], now_ms(),
                                        self.worker_id)
        except RedisError:
            self._not_sent(emitted)
            raise
        if lost:
            self._stop_lost(lost)
            emitted = [e for e in emitted if all(e.seq is not s for s in lost)]
        done = [e.seq for e in emitted if e.seq.finish_reason is not None]
        self._engine.remove({id(s) for s in done})
        if not await self._finish(redis, [chunk_reply(e.seq, e.text, self.worker_id) for e in emitted],
                                  [s.entry_id for s in done], [], progress_of=done):
            self._not_sent(emitted)
            return
        now = monotonic_ms()
        for seq in done:
            self._record_finish(seq, now)

    def _not_sent(self, emitted: list[Emitted]) -> None:
        """After a failed publish: a running sequence's chunk is taken back, so that its next chunk
        starts where this one did (the engine cuts text from text_sent); a finished one keeps its
        chunk, re-sent by the next round (_unsent). Either way the gateway gets the text once: it
        forwards only what continues the text it sent (gateway/protocols/chunks.py)."""
        for e in emitted:
            seq = e.seq
            if seq.finish_reason is not None:
                self._engine.remove({id(seq)})
                self._unsent.append(e)
            else:
                seq.chunk -= 1
                seq.text_sent = seq.text_before

    def _stop_lost(self, lost: list[Sequence]) -> None:
        """Stop the sequences whose entry another worker claimed (or that was acked): that worker
        resumed them from their progress and sends their chunks now; this one must not send more."""
        self._engine.remove({id(s) for s in lost})
        self.stats.lost += len(lost)
        for seq in lost:
            log.warning("sequence lost to another worker's reclaim; stopped here",
                        extra={"request_id": seq.request_id, "entry_id": seq.entry_id,
                               "completion_tokens": len(seq.generated)})

    def _record_finish(self, seq: Sequence, now: float) -> None:
        self.stats.finished += 1
        self._worker_stats.requests += 1
        if seq.first_token_ms is not None and len(seq.generated) > 1:
            self.stats.tpot_count += 1
            self.stats.tpot_ms_sum += (now - seq.first_token_ms) / (len(seq.generated) - 1)
            self._metrics.observe_finished((now - seq.first_token_ms) / (len(seq.generated) - 1))
        log.info("sequence finished", extra={"request_id": seq.request_id, "finish_reason": seq.finish_reason,
                                             "completion_tokens": len(seq.generated), "chunks": seq.chunk})

    async def _drop_gone(self, redis: aioredis.Redis) -> None:
        """Stop the sequences whose client left (a cancel key) or whose deadline passed."""
        seqs = self._sequences()
        flags = await cancel_flags(redis, self._keys, self._model, seqs)
        now = now_ms()
        gone = [(s, c) for s, c in zip(seqs, flags, strict=True) if c or s.deadline_ms <= now]
        if not gone:
            return
        self._engine.remove({id(s) for s, _ in gone})
        replies = []
        for seq, was_cancelled in gone:
            if was_cancelled:
                self.stats.cancelled += 1
                self._worker_stats.cancelled += 1
                seq.finish_reason = "cancelled"
                replies.append(chunk_reply(seq, "", self.worker_id))
            else:
                self._count_failed(1)
                self._worker_stats.expired += not seq.generated  # it never had a token: as if it expired queued
                replies.append(Outgoing(seq.reply_to, ReplyMessage.failure(
                    seq.request_id, DeadlineExceededError.code, "deadline passed while generating",
                    worker_id=self.worker_id)))
            log.info("sequence stopped", extra={"request_id": seq.request_id, "cancelled": was_cancelled,
                                                "completion_tokens": len(seq.generated)})
        await self._finish(redis, replies, [s.entry_id for s, _ in gone], [], progress_of=[s for s, _ in gone])

    async def _fail_all(self, redis: aioredis.Redis, message: str) -> None:
        seqs = list(self._engine.running)  # the step's; the waiting ones did not run
        self._engine.remove({id(s) for s in seqs})
        self._count_failed(len(seqs))
        replies = [Outgoing(s.reply_to, ReplyMessage.failure(s.request_id, ModelError.code, message,
                                                             worker_id=self.worker_id)) for s in seqs]
        await self._finish(redis, replies, [s.entry_id for s in seqs], [], progress_of=seqs)

    async def _refuse(self, redis: aioredis.Redis, entry: Entry, code: str, message: str) -> None:
        assert entry.message is not None
        self._worker_stats.errors += 1
        self._worker_stats.expired += code == DeadlineExceededError.code
        reply = ReplyMessage.failure(entry.message.request_id, code, message, worker_id=self.worker_id)
        await self._finish(redis, [Outgoing(entry.message.reply_to, reply)], [entry.entry_id], [])

    async def _finish(self, redis: aioredis.Redis, replies: list[Outgoing], entry_ids: list[EntryId],
                      dead: list[DeadLetter], progress_of: list[Sequence] = ()) -> bool:  # type: ignore[assignment]
        """Send replies, ack + delete `entry_ids`, then delete the progress of the finished.
        Returns False when the replies and acks were not written (Redis unreachable)."""
        try:
            await publish_replies(redis, request_stream=self._stream,
                                  dead_letter_stream=self._keys.dead_letter_stream(self._model),
                                  queued_requests=self._keys.queued_requests(self._model), replies=replies,
                                  entry_ids=entry_ids, dead_letters=dead,
                                  reply_maxlen=self._settings.reply_stream_maxlen)
            finished = [self._keys.generation_progress(self._model, s.request_id) for s in progress_of
                        if s.entry_id in entry_ids]
        except RedisError as exc:
            # Chunks are sent again by _send's caller; other replies' entries stay pending for reclaim.
            log.error("publish failed", extra={"error": str(exc)})
            return False
        try:
            if finished:
                await redis.delete(*finished)
        except RedisError as exc:  # it expires PROGRESS_SLACK_MS after the request's deadline
            log.warning("progress of finished sequences not deleted", extra={"error": str(exc)})
        return True


def should_read_blocking(server: GenerationServer) -> bool:
    """Block on the stream only when there is nothing to compute."""
    return not server.busy


StopCheck = Callable[[], bool]
