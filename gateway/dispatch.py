"""Hop 2: `Dispatcher` assigns a request id and a deadline, checks admission, enqueues the
request on the model's stream and waits for its reply until the deadline.

Order matters: the future is registered with the ReplyListener before the XADD, so that a
reply arriving faster than this coroutine resumes still finds its waiter.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.health import Health
from gateway.replies import ReplyListener
from shared.clock import monotonic_ms, now_ms
from shared.errors import (
    DeadlineExceededError,
    ModelNotFoundError,
    QueueFullError,
    UnavailableError,
    error_from_code,
)
from shared.keys import Keys
from shared.models import CATALOGUE
from shared.protocol import ENTRY_FIELD, ReplyMessage, RequestId, RequestMessage
from shared.settings import Settings

log = logging.getLogger(__name__)


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

    def __repr__(self) -> str:
        return f"<Dispatcher submitted={self.submitted} answered={self.answered} failed={self.failed}>"

    def check_model(self, model: str) -> None:
        """Raise ModelNotFoundError unless this gateway serves `model`."""
        if model not in self._settings.served_models:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; served: {', '.join(self._settings.served_models)}"
            )

    async def submit(
        self, model: str, inputs: list[object], parameters: dict[str, object], timeout_ms: int | None
    ) -> tuple[RequestId, ReplyMessage]:
        """Enqueue one request and wait for its reply.

        Args:
            inputs: one msgpack-encodable value per item, already validated (gateway/schemas.py).
            timeout_ms: the client's budget; None uses the model's `default_timeout_ms`.

        Returns:
            (request_id, the successful reply).

        Raises:
            ModelNotFoundError, UnavailableError (Redis down or no live worker), QueueFullError,
            DeadlineExceededError, or the error the worker reported (rebuilt by `error_from_code`).
            Every raised error carries the request id once one was assigned.
        """
        self.check_model(model)
        config = self._settings.model_config_for(model)
        request_id = RequestId(uuid.uuid4().hex)
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

    async def _enqueue_and_wait(
        self,
        model: str,
        request_id: RequestId,
        inputs: list[object],
        parameters: dict[str, object],
        timeout_ms: int,
        started_ms: float,
    ) -> ReplyMessage:
        stream = self._keys.request_stream(model)
        config = self._settings.model_config_for(model)
        enqueued_ms = now_ms()
        message = RequestMessage(
            request_id=request_id,
            model=model,
            inputs=inputs,
            reply_to=self._listener.stream,
            deadline_ms=enqueued_ms + timeout_ms,
            enqueued_ms=enqueued_ms,
            parameters=parameters,
        )
        future = self._listener.register(request_id)
        try:
            # Entries are deleted once answered (XACK + XDEL), so XLEN = queued + in flight.
            depth = await self._redis.xlen(stream)
            if depth >= config.queue_bound:
                raise QueueFullError(f"model {model!r} has {depth} entries queued or in flight (bound {config.queue_bound})")
            await self._redis.xadd(stream, {ENTRY_FIELD: message.encode()})
            self.submitted += 1
            remaining_s = max(0.0, (timeout_ms - (monotonic_ms() - started_ms)) / 1000)
            return await asyncio.wait_for(future, remaining_s)
        except TimeoutError as exc:
            raise DeadlineExceededError(f"no reply within {timeout_ms} ms") from exc
        except RedisError as exc:
            raise UnavailableError(f"Redis is unreachable: {exc}") from exc
        finally:
            self._listener.discard(request_id)
