"""The FastAPI application: `create_app(settings)` wires Redis, the ReplyListener, Health and
the Dispatcher in its lifespan, and renders every error with the status from shared/errors.py in
the shape of the route's protocol: `{"error": {"code", "message", "request_id"}}` (native),
`{"error": "<message>"}` (KServe v2, /v2/...), OpenAI's (/v1/embeddings, chat and completions,
paths under /v1/ that no route serves). No redirects: a trailing slash is a 404 like any unknown
path."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from vramguard.gateway.admission.dispatch import Dispatcher
from vramguard.gateway.admission.replies import ReplyListener
from vramguard.gateway.edge.bodybudget import BodyBudget, HoldBodies
from vramguard.gateway.edge.bodycost import JsonCounter
from vramguard.gateway.edge.checks import ClientGoneError
from vramguard.gateway.observe.health import Health
from vramguard.gateway.observe.metrics import GatewayMetrics
from vramguard.gateway.observe.queues import ensure_groups
from vramguard.gateway.observe.routes import router as observe_router
from vramguard.gateway.protocols import chat, kserve, openai_compat
from vramguard.gateway.protocols.native import GatewayApp
from vramguard.gateway.protocols.openapi import install_schemas
from vramguard.gateway.protocols.prompt_tokens import PromptTokens
from vramguard.gateway.routes import (
    INFER_PATH,
    assign_request_id,
    health_router,
    infer_endpoint,
    require_api_key,
    router,
)
from vramguard.shared.clocksync import ClockSync
from vramguard.shared.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    ModelError,
    QueueFullError,
    UnauthorizedError,
    UnavailableError,
    VramguardError,
)
from vramguard.shared.failover import PrimaryWatch
from vramguard.shared.keys import Keys
from vramguard.shared.redis_client import check_eviction_policy, close, connect, connect_blocking
from vramguard.shared.settings import Settings
from vramguard.shared.tasks import TaskWatch

log = logging.getLogger(__name__)


def error_body(code: str, message: str, request_id: str | None) -> dict[str, object]:
    return {"error": {"code": code, "message": message, "request_id": request_id}}


def create_app(settings: Settings) -> GatewayApp:
    """Build the gateway app for `settings`. Redis is connected in the lifespan, not here."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway_id = uuid.uuid4().hex[:12]
        keys = Keys(settings.key_prefix)
        redis = connect(settings)
        blocking = connect_blocking(settings)
        primary_watch = PrimaryWatch(settings)
        primary_watch.start([redis, blocking])
        listener = ReplyListener(settings, redis, blocking, keys.reply_stream(gateway_id), pause=primary_watch.pause)
        tasks = TaskWatch(lambda reason: log.critical(
            "a long-lived task ended; this gateway cannot serve and exits for a restart", extra={"reason": reason}))
        health = Health(settings, redis, keys, tasks)
        app.state.settings = settings
        app.state.health = health
        app.state.dispatcher = Dispatcher(settings, redis, keys, listener, health)
        app.state.metrics = metrics = GatewayMetrics(settings, redis, keys, health)
        app.state.listener = listener
        app.state.redis = redis
        app.state.keys = keys
        app.state.json_counter = json_counter = JsonCounter(settings.max_json_values)
        json_counter.start()
        app.state.prompt_tokens = PromptTokens(redis, keys)  # generative models' context-window check
        clock = ClockSync(redis)
        await clock.start()  # deadlines and heartbeat ages on Redis' clock (shared/clock.py)
        await listener.start()
        assert clock.task is not None
        tasks.watch(clock.task)
        listener.watch(tasks)
        try:
            await check_eviction_policy(redis, settings)  # raises RuntimeError under redis_eviction_check=refuse
            await ensure_groups(redis, keys, settings.served_models)
        except RedisError as exc:
            # Start anyway: readiness and admission answer 503 until Redis answers, and the first
            # worker to connect creates the groups (docs/concepts/architecture.md "When things fail": Redis down
            # means 503, then recovery).
            log.warning("Redis unreachable at start; answering 503 until it is back", extra={"error": str(exc)})
        await health.start()
        log.info("gateway started", extra={"gateway_id": gateway_id, "settings": settings.masked()})
        try:
            yield
        finally:
            # Reverse order of startup: stop admitting, drain, fail the rest, stop readers, close.
            await drain_requests(app)
            tasks.stop()
            metrics.close()  # drained: nothing of ours in flight stays in the host's sums
            await health.stop()
            await listener.stop()
            await clock.stop()
            await primary_watch.stop()
            await close(blocking)
            await close(redis)
            await json_counter.aclose()
            log.info("gateway stopped", extra={"gateway_id": gateway_id})

    app = GatewayApp(title="vramguard", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.body_budget = BodyBudget(settings.max_inflight_body_bytes)
    app.add_middleware(HoldBodies, budget=app.body_budget)
    # GatewayApp serves the native inference route ahead of the middleware stack (gateway/protocols/native.py);
    # this plain Starlette route of it (routes.infer_endpoint says why) answers only what reaches the
    # stack, and the FastAPI route of the same path, behind it, describes it in the OpenAPI schema.
    app.router.routes.append(Route(INFER_PATH, infer_endpoint, methods=["POST"]))
    app.include_router(router)
    # The request id first, so that a 401 and the errors found before the body is read carry it.
    app.include_router(openai_compat.router, dependencies=[Depends(assign_request_id), Depends(require_api_key)])
    app.include_router(chat.router, dependencies=[Depends(assign_request_id), Depends(require_api_key)])
    app.include_router(kserve.router, dependencies=[Depends(require_api_key)])
    app.include_router(kserve.health_router)
    app.include_router(health_router)
    app.include_router(observe_router)
    install_schemas(app, settings.served_models, invalid_is_400)
    _install_error_handlers(app)
    return app


async def drain_requests(app: FastAPI) -> None:
    """Graceful shutdown, second half: admission answers 503 from now on, requests in flight get
    up to `shutdown_grace_s` for their reply, the rest fail with 503. Idempotent;
    gateway/__main__.py calls it after shutdown_delay_s on SIGTERM while uvicorn still serves, the
    lifespan again at exit."""
    health: Health = app.state.health
    listener: ReplyListener = app.state.listener
    health.shutting_down = health.admission_closed = True
    await chat.end_open_streams(app, app.state.settings.shutdown_grace_s)
    loop = asyncio.get_running_loop()
    until = loop.time() + app.state.settings.shutdown_grace_s
    while listener.waiting and loop.time() < until:
        await asyncio.sleep(0.05)
    listener.fail_all(UnavailableError("the gateway shut down before the reply came"))


async def shut_down(app: FastAPI) -> None:
    """Graceful shutdown on SIGTERM: readiness fails at once, but for `shutdown_delay_s` requests
    and new connections are still served (a load balancer routes to this gateway until it has seen
    that), then drain_requests."""
    app.state.health.shutting_down = True
    delay_s = app.state.settings.shutdown_delay_s
    log.info("shutting down: not ready; serving on until the delay is over, then draining",
             extra={"shutdown_delay_s": delay_s, "shutdown_grace_s": app.state.settings.shutdown_grace_s})
    await asyncio.sleep(delay_s)
    await drain_requests(app)


def broken_task(app: FastAPI) -> str | None:
    """Which long-lived task ended while the gateway runs (shared/tasks.py), else None; the
    process must then exit for a restart."""
    health: Health | None = getattr(app.state, "health", None)
    return health.tasks.ended if health is not None else None


def fail_waiting(app: FastAPI) -> None:
    """A broken gateway's end: no reply can arrive any more, so admission closes and every waiting
    request gets 503 now, not at its deadline."""
    app.state.health.shutting_down = app.state.health.admission_closed = True
    app.state.listener.fail_all(UnavailableError("the gateway lost a background task and restarts; retry"))


def _request_id(request: Request) -> str | None:
    """The id inference.request_id_of assigned to this request on arrival (inference only), else None."""
    return getattr(request.state, "request_id", None)


def _error_headers(exc: VramguardError) -> dict[str, str]:
    """Retry-After where waiting helps (429, 503); `x-should-retry: false` where a retry of the same
    request cannot help, so clients that retry 5xx by default (openai's) send one request, not three."""
    if isinstance(exc, QueueFullError):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, UnavailableError):
        return {"Retry-After": "1"}
    headers = {"x-should-retry": "false"} if isinstance(exc, DeadlineExceededError | ModelError) else {}
    if isinstance(exc, UnauthorizedError):
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def _is_v2(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def _is_openai_route(path: str) -> bool:
    return path == openai_compat.PATH or path in chat.PATHS


def invalid_is_400(path: str) -> bool:
    """Whether an invalid request to `path` is answered 400 rather than 422: on the v2 routes, as
    Triton answers every invalid request, and on the OpenAI routes, as OpenAI's API does (its
    `openai` client raises BadRequestError for it)."""
    return _is_v2(path) or _is_openai_route(path)


def render_error(
    request: Request, status: int, code: str, message: str, headers: Mapping[str, str] | None = None,
    *, unrouted: bool = False,
) -> JSONResponse:
    """An error response in the shape of the protocol the request's path speaks. `unrouted`: no
    route serves the path (or not its method); a path none serves under /v1/ is answered in
    OpenAI's shape, the one a client of a route we lack (an `openai` client's /v1/responses) reads,
    and a superset of ours."""
    request_id = _request_id(request)
    path = request.url.path
    body: object
    if status == 422 and invalid_is_400(path):
        status = 400
    if _is_v2(path):
        body = kserve.error_body(message)
    # A path no route serves (404) under /v1/ gets OpenAI's shape: an `openai` client of a route we
    # lack reads it. A wrong method (405) names a route we have: its own shape.
    elif _is_openai_route(path) or unrouted and status == 404 and path.startswith("/v1/"):
        # OpenAI names the field a context_length_exceeded is about; clients (LiteLLM) read it.
        param = chat.PROMPT_PARAM.get(path) if code == ContextLengthExceededError.code else None
        body = openai_compat.error_body(status, code, message, request_id, param)
    else:
        body = error_body(code, message, request_id)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _http_code(status: int) -> str:
    """The error code of a Starlette HTTPException: its status phrase in snake case (404 not_found,
    405 method_not_allowed), or http_<status> for a status without one."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(VramguardError)
    async def _vramguard_error(request: Request, exc: VramguardError) -> JSONResponse:
        if exc.request_id and not _request_id(request):
            request.state.request_id = exc.request_id
        return render_error(request, exc.http_status, exc.code, exc.message, _error_headers(exc))

    @app.exception_handler(ClientGoneError)
    async def _client_gone(request: Request, exc: ClientGoneError) -> Response:
        return Response(status_code=exc.http_status)  # nobody reads it; uvicorn drops it

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return render_error(request, 422, "invalid_input", _summarise(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own 404 (no route) and 405 (wrong method, with its Allow header), in our format.
        message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
        headers = dict(exc.headers or {})
        allowed = headers.get("Allow", "").split(", ")
        if "GET" in allowed and "HEAD" not in allowed:
            headers["Allow"] = ", ".join([*allowed, "HEAD"])  # served for every GET route (gateway/protocols/native.py)
        return render_error(request, exc.status_code, _http_code(exc.status_code), message, headers,
                            unrouted=True)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path, "request_id": _request_id(request)})
        # Starlette re-raises after this response and uvicorn then closes the connection: said here
        # (RFC 9112 9.6), so that a client does not send its next request on it.
        return render_error(request, 500, "internal", "internal error",
                            {"x-should-retry": "false", "connection": "close"})


def _summarise(errors: Sequence[Any]) -> str:
    """FastAPI's validation errors (path and header parameters) as one line: location and message."""
    return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:3])
