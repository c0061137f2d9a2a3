"""Hop 2: `Dispatcher` takes the request id routes.py assigned, sets a deadline, checks admission, enqueues the
request on the model's stream and waits for its reply until the deadline.

Order matters: the future is registered with the ReplyListener before the XADD, so that a
reply arriving faster than this coroutine resumes still finds its waiter.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.gateway.admission.backpressure import ThroughputMeter, retry_after_s
from vramguard.gateway.admission.coalesce import ScriptBatcher
from vramguard.gateway.admission.deadline import Deadline
from vramguard.gateway.admission.replies import INIT_FIELD, ReplyListener, ReplyStream
from vramguard.gateway.observe.health import Health
from vramguard.shared.clock import monotonic_ms, now_ms
from vramguard.shared.errors import (
    DeadlineExceededError,
    InvalidInputError,
    ModelNotFoundError,
    QueueFullError,
    UnavailableError,
    error_from_code,
)
from vramguard.shared.keys import Keys
from vramguard.shared.models import ModelConfig
from vramguard.shared.protocol import (
    ENTRY_FIELD,
    REQUESTS_FIELD,
    ReplyMessage,
    RequestId,
    RequestMessage,
    new_request_id,
)
from vramguard.shared.redis_client import RETRY_WINDOW_S, describe_refusal
from vramguard.shared.settings import Settings
from vramguard.shared.tracing import ATTR_QUEUE_BOUND, carrier, child_span, reply_attributes

log = logging.getLogger(__name__)

# Admission of every request one round trip carries for one model, in one script call, atomic,
# on the model's hash slot only, and idempotent per call.
# KEYS: request stream, queued-requests counter, the admission records hash (all one slot: shared/keys.py).
# ARGV: queue_bound, entry field, record TTL ms, queue_bound_bytes, requests field, requests per
# entry, the call's id, now (epoch ms, Redis' clock), then each packed request.
# - The admitted requests share stream entries: up to ARGV[6] in one entry (field ARGV[5], a
#   msgpack array; worker/batch/entries.py splits it), so a call of 20 requests costs one XADD, not 20.
#   A lone request keeps an entry of its own (field ARGV[2]).
# - redis-py re-sends a command whose reply was lost (timeout, cut connection) although it may
#   have run: the call's record (its answer, msgpack, with the time it expires: RETRY_WINDOW_S +
#   1 s later) makes the re-sent call return the first run's answer instead of enqueueing, and
#   counting, its requests twice. One record per call, not per request, as a field of the model's
#   records hash (KEYS[3], which the field `_` keeps in existence: during a Cluster slot migration a
#   script naming a missing key gets TRYAGAIN, and a key per call was always missing). Expired
#   records are dropped by sampling, as Redis expires keys: 8 random fields per admitting call.
#   A call that added nothing leaves no record (running it again adds nothing twice).
# - The bound counts requests. XLEN counts entries, so the queued-requests counter does: raised here,
#   lowered by the worker's MULTI that XACKs and XDELs an answered entry (worker/batch/publish.py). An
#   entry holds at least one request, so XLEN is a floor for it, and an empty stream means none:
#   the counter heals from both whatever wrote entries past it (a test, a tool, lost data). At the
#   bound nothing is added (never trim accepted entries to make room): {0, depth}, else {1, id}.
# - The stream's bytes in Redis (MEMORY USAGE: the entries' listpacks, sampled) plus the requests
#   this call adds must stay within queue_bound_bytes: {2, bytes held} past it.
# - OOM and READONLY refuse the first write of a script, so they fail the whole call before it
#   has written anything, and the caller retries or answers each request of it.
# XLEN, the counter and MEMORY USAGE are read once per call and advanced by what the call adds, so
# a call of 64 requests answers each as 64 calls in a row would (the bytes by the packed requests'
# length: the entries' few bytes of overhead are counted at the next call). Returns one
# {status, value} per request, in ARGV order.
ADMISSION = """
local call_id, now = ARGV[7], tonumber(ARGV[8])
local done = redis.call('HGET', KEYS[3], call_id)
if done then return cmsgpack.unpack(done)[2] end
local bound, field, ttl, bound_bytes = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pack_field, per_entry = ARGV[5], tonumber(ARGV[6])
local length = redis.call('XLEN', KEYS[1])
local depth = tonumber(redis.call('GET', KEYS[2]) or '0')
if length == 0 then depth = 0 elseif depth < length then depth = length end
local held = nil
local out, admitted, slots = {}, {}, {}
for i = 9, #ARGV do
  local packed = ARGV[i]
  if depth >= bound then
    out[i - 8] = {0, depth}
  else
    if held == nil then held = redis.call('MEMORY', 'USAGE', KEYS[1]) or 0 end
    if held + string.len(packed) > bound_bytes then
      out[i - 8] = {2, held}
    else
      admitted[#admitted + 1] = packed
      slots[#slots + 1] = i - 8
      depth = depth + 1
      held = held + string.len(packed)
    end
  end
end
if #admitted == 0 then return out end
local first = 1
while first <= #admitted do
  local last = math.min(first + per_entry - 1, #admitted)
  local id
  if first == last then
    id = redis.call('XADD', KEYS[1], '*', field, admitted[first])
  else
    id = redis.call('XADD', KEYS[1], '*', pack_field, cmsgpack.pack({unpack(admitted, first, last)}))
  end
  for j = first, last do out[slots[j]] = {1, id} end
  first = last + 1
end
redis.call('SET', KEYS[2], depth)
local sample = redis.call('HRANDFIELD', KEYS[3], 8, 'WITHVALUES')
for i = 1, #sample, 2 do
  if sample[i] ~= '_' and cmsgpack.unpack(sample[i + 1])[1] <= now then redis.call('HDEL', KEYS[3], sample[i]) end
end
redis.call('HSET', KEYS[3], '_', '', call_id, cmsgpack.pack({now + ttl, out}))
return out
"""

# The reply stream, on this gateway's hash slot. KEYS: reply stream. ARGV: init field, maxlen, TTL s.
# A missing reply stream means Redis lost its data; it is recreated before the worker can answer
# (workers XADD with NOMKSTREAM): returns 1 when it had to, else 0. A separate script from
# ADMISSION because under Redis Cluster the two keys live in different slots (shared/keys.py).
ENSURE_REPLY_STREAM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[1], '1')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
ADMISSION_RECORD_TTL_MS = int(RETRY_WINDOW_S * 1000) + 1000
# ENSURE_REPLY_STREAM goes with at most one admission round trip in this many ms, not with every
# one: at concurrency 64 it was two of the ~15 commands per round trip (0.13 per request). Redis
# losing its data is rare, and requests admitted in the window after it (their replies dropped by
# NOMKSTREAM) are failed as lost by the next check or the reply stream's keepalive, with those
# enqueued before it.
REPLY_CHECK_INTERVAL_MS = 100
# The longest a request waits for its admission's round trip: a frozen Redis (SIGSTOP, a VM pause)
# or a stopped primary answers nothing, and the request gets 503 this soon instead of waiting out
# its deadline behind round trips that each wait COMMAND_TIMEOUT_S (shared/redis_client.py). An
# admission already sent may still land once Redis answers: its entry then runs for nobody.
ADMISSION_TIMEOUT_S = 2.0


class Dispatcher:
    """Submits requests to workers through Redis and returns their replies.

    Counters (`submitted`, `answered`, `failed`) feed `__repr__` for logs and tests.
    """

    def __init__(
        self, settings: Settings, redis: aioredis.Redis, keys: Keys, listener: ReplyListener, health: Health
    ) -> None:
        self._settings = settings
        self._redis = redis
        self._keys = keys
        self._listener = listener
        self._health = health
        self.submitted = 0
        self.answered = 0
        self.failed = 0
        self._throughput = {model: ThroughputMeter() for model in settings.served_models}
        self._waiting = dict.fromkeys(settings.served_models, 0)  # admitted, reply not yet here (backpressure.py)
        self._admission = redis.register_script(ADMISSION)
        self._ensure_reply = redis.register_script(ENSURE_REPLY_STREAM)
        self._scripts = ScriptBatcher(redis)
        self._checked_ms = -float(REPLY_CHECK_INTERVAL_MS)  # when the last reply-stream check was queued (monotonic)
        self._configs: dict[str, ModelConfig] = {}

    def __repr__(self) -> str:
        return f"<Dispatcher submitted={self.submitted} answered={self.answered} failed={self.failed}>"

    def config_for(self, model: str) -> ModelConfig:
        """`model`'s settings (Settings.model_config_for), built once: settings do not change while
        the gateway runs, and rebuilding them costs a pydantic validation per call."""
        config = self._configs.get(model)
        if config is None:
            config = self._configs[model] = self._settings.model_config_for(model)
        return config

    def check_model(self, model: str) -> None:
        """Raise ModelNotFoundError unless this gateway serves `model`."""
        if model not in self._settings.served_models:
            raise ModelNotFoundError(  # the name is the client's: echoed cut, as every echo of input is
                f"model {model[:100]!r} is not served here; served: {', '.join(self._settings.served_models)}"
            )

    async def submit(
        self,
        model: str,
        inputs: list[object],
        parameters: dict[str, object],
        timeout_ms: int | None,
        *,
        request_id: RequestId | None = None,
    ) -> tuple[RequestId, ReplyMessage]:
        """Enqueue one request and wait for its reply.

        Args:
            inputs: one msgpack-encodable value per item, already validated (gateway/protocols/schemas.py).
            timeout_ms: the client's budget; None uses the model's `default_timeout_ms`.
            request_id: the id routes.py assigned when the request arrived (so its early errors
                carry it too); None assigns a fresh one here.

        Returns:
            (request_id, the successful reply).

        Raises:
            ModelNotFoundError, UnavailableError (Redis down or no live worker), QueueFullError,
            DeadlineExceededError, or the error the worker reported (rebuilt by `error_from_code`).
            Every raised error carries the request id once one was assigned.
        """
        self.check_model(model)
        if self._settings.spec_for(model).options.get("generates"):
            # Its worker answers in numbered chunks that only the streaming routes read.
            raise InvalidInputError(f"model {model[:100]!r} generates text: use POST /v1/chat/completions or "
                                    "POST /v1/completions", request_id=request_id)
        config = self.config_for(model)
        request_id = request_id or new_request_id()
        started_ms = monotonic_ms()
        timeout_ms = timeout_ms or config.default_timeout_ms
        try:
            self._health.require_worker(model)
            reply = await self._enqueue_and_wait(model, request_id, inputs, parameters, timeout_ms, started_ms)
        except (UnavailableError, QueueFullError, DeadlineExceededError) as exc:
            self.failed += 1
            exc.request_id = request_id
            raise
        if not reply.ok:
            self.failed += 1
            raise error_from_code(reply.error_code or "model_error", reply.error_message or "", request_id=request_id)
        self.answered += 1
        return request_id, reply

    async def open_stream(self, model: str, inputs: list[object], parameters: dict[str, object], timeout_ms: int,
                          request_id: RequestId, bound: int) -> ReplyStream:
        """Enqueue a request whose reply comes as numbered chunks (a generative model) and return
        their ReplyStream; the caller reads it and calls `close_stream` when done. Raises
        UnavailableError, QueueFullError, DeadlineExceededError as `submit` does."""
        self.check_model(model)
        self._health.require_worker(model)
        enqueued_ms = now_ms()
        message = RequestMessage(request_id=request_id, model=model, inputs=inputs, reply_to=self._listener.stream,
                                 deadline_ms=enqueued_ms + timeout_ms, enqueued_ms=enqueued_ms, parameters=parameters)
        stream = self._listener.register_stream(request_id, bound)
        try:
            await asyncio.wait_for(asyncio.shield(self._admit(model, message)),
                                   min(timeout_ms / 1000, ADMISSION_TIMEOUT_S))
        except TimeoutError as exc:
            self._listener.discard(request_id)
            if timeout_ms / 1000 <= ADMISSION_TIMEOUT_S:
                raise DeadlineExceededError(f"not queued within {timeout_ms} ms") from exc
            raise UnavailableError(self._not_answered()) from exc
        except RedisError as exc:
            self._listener.discard(request_id)
            raise UnavailableError("the broker is unreachable; retry later", detail=str(exc)) from exc
        except BaseException:
            self._listener.discard(request_id)
            raise
        self._listener.mark_enqueued(request_id)
        self.submitted += 1
        return stream

    async def close_stream(self, model: str, request_id: RequestId, *, cancel: bool) -> None:
        """Forget a streamed request; with `cancel` (the client left, or was cut) tell its worker
        to stop the sequence: a key it checks every decode step, expiring after the model's timeout."""
        self._listener.discard(request_id)
        if cancel:
            ttl_ms = self.config_for(model).default_timeout_ms + 60_000
            try:
                await self._redis.set(self._keys.cancel(model, request_id), b"1", px=ttl_ms)
            except RedisError as exc:
                log.warning("cancel not recorded; the sequence runs to its end", extra={"error": str(exc)})

    async def _enqueue_and_wait(
        self,
        model: str,
        request_id: RequestId,
        inputs: list[object],
        parameters: dict[str, object],
        timeout_ms: int,
        started_ms: float,
    ) -> ReplyMessage:
        enqueued_ms = now_ms()
        message = RequestMessage(
            request_id=request_id,
            model=model,
            inputs=inputs,
            reply_to=self._listener.stream,
            deadline_ms=enqueued_ms + timeout_ms,
            enqueued_ms=enqueued_ms,
            parameters=parameters,
            trace=carrier(),  # None unless tracing is on: the worker's spans join this request's trace
        )
        future = self._listener.register(request_id)
        try:
            # One deadline over admission and reply, one timer: what expires is only this request's
            # wait. The admission's round trip is the ScriptBatcher's task, which nobody cancels (a
            # cancelled redis-py command can poison its connection): past the deadline we answer 504;
            # an admission still waiting for its round trip is then left out of it, and an entry
            # already added is answered to nobody (its reply is dropped).
            with Deadline(self._remaining_s(timeout_ms, started_ms)):
                await self._admit_within(model, message)
                self._listener.mark_enqueued(request_id)
                self.submitted += 1
                self._waiting[model] += 1
                try:
                    # Queued, batched, run and published: until the reply is here.
                    with child_span("vramguard.reply") as span:
                        reply = await future
                        if span is not None:
                            span.set_attributes(reply_attributes(reply))
                finally:
                    self._waiting[model] -= 1
            self._throughput[model].record()
            return reply
        except TimeoutError as exc:
            raise DeadlineExceededError(f"no reply within {timeout_ms} ms") from exc
        except RedisError as exc:
            # The client gets no hostnames or Redis text; the request's log line has them (detail).
            refusal = describe_refusal(exc)
            if refusal is not None:
                # Nothing was added (Redis refuses the write whole); serving resumes once Redis takes writes.
                raise UnavailableError(f"{refusal}; request not queued, retry later", detail=str(exc)) from exc
            raise UnavailableError("the broker is unreachable; retry later", detail=str(exc)) from exc
        finally:
            self._listener.discard(request_id)

    async def _admit_within(self, model: str, message: RequestMessage) -> None:
        """`_admit` bounded by ADMISSION_TIMEOUT_S: past it, UnavailableError (503), the request's own
        deadline notwithstanding (it stays the bound when it is the shorter)."""
        bound = Deadline(ADMISSION_TIMEOUT_S)
        try:
            with bound:
                await self._admit(model, message)
        except TimeoutError:
            if not bound.expired:
                raise
            raise UnavailableError(self._not_answered()) from None

    def _not_answered(self) -> str:
        """The 503's message for an admission past ADMISSION_TIMEOUT_S: Redis' refusal when the health
        refresh saw one (a read-only replica's writes are retried until then), else a stall."""
        refusal = self._health.view.redis_refusal
        if refusal is not None:
            return f"{refusal}; request not queued, retry later"
        return (f"Redis did not answer within {ADMISSION_TIMEOUT_S:g} s (stalled, or its primary is stopped); "
                "request not queued, retry later")

    async def _admit(self, model: str, message: RequestMessage) -> None:
        """Check the bound and XADD in one step (ADMISSION, one call for one round trip's admissions
        to the model), after ENSURE_REPLY_STREAM has checked the reply stream when a check is due
        (`_reply_check`): both in the one round trip these admissions share (gateway/admission/coalesce.py;
        two slots under Cluster).
        Awaited by the request's own task: cancelling it (deadline, disconnect) cancels only this
        request's wait for its item of the round trip. Raises QueueFullError with a Retry-After
        from this gateway's recent reply rate (gateway/admission/backpressure.py), or RedisError."""
        config = self.config_for(model)
        self._throughput[model].note_demand(self._waiting[model])
        with child_span("vramguard.admission", {ATTR_QUEUE_BOUND: config.queue_bound}):
            check = self._reply_check()
            # Grouped: the round trip's admissions for the model are one script call (ADMISSION).
            admitted = await self._scripts.call_grouped(
                self._admission, [self._keys.request_stream(model), self._keys.queued_requests(model),
                                  self._keys.admissions(model)],
                [config.queue_bound, ENTRY_FIELD, ADMISSION_RECORD_TTL_MS, config.queue_bound_bytes, REQUESTS_FIELD,
                 self._requests_per_entry(model)],
                [], [message.encode()], call_args=lambda: [secrets.token_hex(16), now_ms()])
            # A check queued with this admission was answered in the same round trip, ahead of it
            # (run_scripts keeps the calls' order, and an item's answer is set one callback after its call's).
            checked = None if check is None else check.result() if check.done() else await asyncio.shield(check)
        for result in (checked, admitted):
            if isinstance(result, BaseException):  # a script's error (run_scripts answers it as a value)
                raise result
        status, value = cast(list[object], admitted)
        if status == 0:
            retry_s = retry_after_s(int(cast(int, value)), self._throughput[model].rate_per_s())
            raise QueueFullError(
                f"model {model!r} has {value} requests queued or in flight (bound {config.queue_bound})",
                retry_after_s=retry_s,
            )
        if status == 2:
            raise QueueFullError(  # no entry count to rate: a second, as for a queue that drains at all
                f"model {model!r}'s queue holds {value} bytes in Redis; this request would pass its bound of "
                f"{config.queue_bound_bytes} (queue_bound_bytes)", retry_after_s=1)

    def _reply_check(self) -> asyncio.Future[object] | None:
        """A new ENSURE_REPLY_STREAM check for the admission about to be queued, once
        REPLY_CHECK_INTERVAL_MS have passed since the last one was queued; else None. Queued ahead
        of the admission, so answered ahead of it and of the others of its round trip (in the
        data-loss case the stream exists again before a worker can have read, run and answered
        their entries). Never one already sent: an admission must not wait for, or fail with, a
        round trip it is not in (a stalled one is left behind after STALL_S, gateway/admission/coalesce.py)."""
        now = monotonic_ms()
        if now - self._checked_ms < REPLY_CHECK_INTERVAL_MS:
            return None
        self._checked_ms = now
        check = self._scripts.call(self._ensure_reply, [self._listener.stream],
                                   [INIT_FIELD, self._settings.reply_stream_maxlen, self._settings.reply_stream_ttl_s])
        check.add_done_callback(self._reply_stream_checked)
        return check

    def _requests_per_entry(self, model: str) -> int:
        """How many of one call's requests may share a stream entry: the model's
        `requests_per_entry` (shared/models.py); 1 for a generative model, whose worker takes each
        request as a sequence of its own (worker/generate/intake.py reads one request per entry)."""
        if self._settings.spec_for(model).options.get("generates"):
            return 1
        return self.config_for(model).requests_per_entry

    def _reply_stream_checked(self, check: asyncio.Future[object]) -> None:
        """The reply stream was missing (the check recreated it): Redis lost its data, and every
        request enqueued before fails now (ReplyListener.stream_lost). Run as the check's callback,
        before any admission of its round trip is answered, so none of those is counted as lost."""
        if check.cancelled() or check.exception() is not None or check.result() != 1:
            return
        log.warning("reply stream was missing: Redis lost its data", extra={"stream": self._listener.stream})
        self._listener.stream_lost()

    @staticmethod
    def _remaining_s(timeout_ms: int, started_ms: float) -> float:
        return max(0.0, (timeout_ms - (monotonic_ms() - started_ms)) / 1000)
