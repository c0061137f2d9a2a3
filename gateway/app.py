"""The FastAPI application: `create_app(settings)` wires Redis, the ReplyListener, Health and
the Dispatcher in its lifespan, and renders every error as
`{"error": {"code", "message", "request_id"}}` with the status from shared/errors.py."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.dispatch import Dispatcher
from gateway.health import Health
from gateway.metrics import GatewayMetrics
from gateway.observe import router as observe_router
from gateway.replies import ReplyListener
from gateway.routes import health_router, router
from shared.clocksync import ClockSync
from shared.errors import QueueFullError, UnauthorizedError, UnavailableError, VramguardError
from shared.keys import Keys
from shared.redis_client import connect, connect_blocking
from shared.settings import Settings

log = logging.getLogger(__name__)


def error_body(code: str, message: str, request_id: str | None) -> dict[str, object]:
    return {"error": {"code": code, "message": message, "request_id": request_id}}


def create_app(settings: Settings) -> FastAPI:
    """Build the gateway app for `settings`. Redis is connected in the lifespan, not here."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway_id = uuid.uuid4().hex[:12]
        keys = Keys(settings.key_prefix)
        redis = connect(settings)
        blocking = connect_blocking(settings)
        listener = ReplyListener(settings, redis, blocking, keys.reply_stream(gateway_id))
        health = Health(settings, redis, keys)
        app.state.settings = settings
        app.state.health = health
        app.state.dispatcher = Dispatcher(settings, redis, keys, listener, health)
        app.state.metrics = GatewayMetrics(settings, redis, keys, health)
        app.state.listener = listener
        clock = ClockSync(redis)
        await clock.start()  # deadlines and heartbeat ages on Redis' clock (shared/clock.py)
        await listener.start()
        await health.start()
        log.info("gateway started", extra={"gateway_id": gateway_id, "settings": settings.masked()})
        try:
            yield
        finally:
            # Reverse order of startup: stop admitting, drain, fail the rest, stop readers, close.
            await drain_requests(app)
            await health.stop()
            await listener.stop()
            await clock.stop()
            await blocking.aclose()
            await redis.aclose()
            log.info("gateway stopped", extra={"gateway_id": gateway_id})

    app = FastAPI(title="vramguard", version="0.1.0", lifespan=lifespan)
    app.include_router(router)
    app.include_router(health_router)
    app.include_router(observe_router)
    _install_error_handlers(app)
    return app


async def drain_requests(app: FastAPI) -> None:
    """Graceful shutdown, first half (issue 4): readiness and admission answer 503 from now on,
    requests in flight get up to `shutdown_grace_s` for their reply, the rest fail with 503.
    Idempotent; gateway/__main__.py calls it on SIGTERM while uvicorn still serves, the lifespan
    again at exit."""
    health: Health = app.state.health
    listener: ReplyListener = app.state.listener
    health.shutting_down = True
    loop = asyncio.get_running_loop()
    until = loop.time() + app.state.settings.shutdown_grace_s
    while listener.waiting and loop.time() < until:
        await asyncio.sleep(0.05)
    listener.fail_all(UnavailableError("the gateway shut down before the reply came"))


def _request_id(request: Request) -> str | None:
    """The id routes.py assigned to this request on arrival (inference only), else None."""
    return getattr(request.state, "request_id", None)


def _error_headers(exc: VramguardError) -> dict[str, str] | None:
    if isinstance(exc, QueueFullError):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, UnauthorizedError):
        return {"WWW-Authenticate": "Bearer"}
    return None


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
        request_id = exc.request_id or _request_id(request)
        return JSONResponse(
            error_body(exc.code, exc.message, request_id), status_code=exc.http_status, headers=_error_headers(exc)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body("invalid_input", str(exc.errors()[:3]), _request_id(request)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own 404 (no route) and 405 (wrong method, with its Allow header), in our format.
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(_http_code(exc.status_code), message, _request_id(request)),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path, "request_id": _request_id(request)})
        return JSONResponse(error_body("internal", "internal error", _request_id(request)), status_code=500)
