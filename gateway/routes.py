"""Hop 1: thin HTTP handlers. They parse, call the Dispatcher or Health, and render; every
error is raised as a VramguardError and rendered by app.py's handlers. `router` holds the
`/v1/...` routes, behind the API key when one is set; `health_router` stays open for probes."""

from __future__ import annotations

import secrets
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from gateway.dispatch import Dispatcher
from gateway.health import Health
from gateway.schemas import (
    MAX_TIMEOUT_MS,
    InferResponse,
    ModelInfo,
    ModelList,
    check_input_count,
    jsonable,
    parse_infer_request,
    validate_inputs,
)
from shared.errors import InvalidInputError, PayloadTooLargeError, UnauthorizedError
from shared.models import CATALOGUE
from shared.protocol import RequestId
from shared.settings import Settings


def require_api_key(request: Request) -> None:
    """When `Settings.api_key` is set, the request must carry it as `Authorization: Bearer <key>` or
    `X-API-Key: <key>`; else UnauthorizedError (401). Compared in constant time."""
    key = _settings(request).api_key
    if key is None:
        return
    expected = key.get_secret_value().encode()
    # Header values arrive as latin-1 text (ASGI); back to their bytes, as the client sent them.
    if not any(secrets.compare_digest(given.encode("latin-1"), expected) for given in _presented_keys(request.headers)):
        raise UnauthorizedError("missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")


def _presented_keys(headers: Headers) -> list[str]:
    keys = headers.getlist("x-api-key")
    for value in headers.getlist("authorization"):
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer":
            keys.append(token.strip())
    return keys


router = APIRouter(dependencies=[Depends(require_api_key)])
health_router = APIRouter()


def _dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher  # type: ignore[no-any-return]


def _health(request: Request) -> Health:
    return request.app.state.health  # type: ignore[no-any-return]


def _settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


@router.post("/v1/models/{model}/infer", response_model=InferResponse)
async def infer(
    model: str,
    request: Request,
    x_request_timeout_ms: Annotated[str | None, Header()] = None,
) -> InferResponse:
    """Run `inputs` through `model`; one output per input, in order.

    The request id is assigned first, so every error of this request carries it (app.py's
    handlers read `request.state.request_id`), and the Dispatcher uses the same one end to end.
    """
    request_id = RequestId(uuid.uuid4().hex)
    request.state.request_id = request_id
    dispatcher = _dispatcher(request)
    dispatcher.check_model(model)
    with request.app.state.metrics.track(model) as record:  # issue 5: counts, latency, one log line
        record.request_id = request_id
        header_ms = _header_timeout(x_request_timeout_ms)  # checked even when the body wins
        body = await _read_body(request, _settings(request).max_body_bytes)
        parsed = parse_infer_request(body)
        check_input_count(model, _settings(request).model_config_for(model), len(parsed.inputs))
        validate_inputs(CATALOGUE[model], parsed.inputs)
        timeout_ms = parsed.timeout_ms or header_ms
        _, reply = await dispatcher.submit(
            model, list(parsed.inputs), dict(parsed.parameters), timeout_ms, request_id=request_id
        )
        record.reply = reply
    return InferResponse(model=model, request_id=request_id, outputs=[jsonable(v) for v in reply.outputs or []])


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The served models with their batching settings and live workers."""
    return ModelList(models=[_model_info(request, name) for name in _settings(request).served_models])


@router.get("/v1/models/{model}", response_model=ModelInfo)
async def get_model(model: str, request: Request) -> ModelInfo:
    _dispatcher(request).check_model(model)
    return _model_info(request, model)


@health_router.api_route("/health/live", methods=["GET", "HEAD"])
async def live() -> dict[str, str]:
    """Liveness: the gateway process answers."""
    return {"status": "live"}


@health_router.api_route("/health/ready", methods=["GET", "HEAD"])
async def ready(request: Request) -> JSONResponse:
    """Readiness: Redis answers and every served model has a worker with a fresh heartbeat and a
    recent successful probe; else 503 with the reasons."""
    ok, details = _health(request).readiness()
    return JSONResponse(details, status_code=200 if ok else 503)


@router.get("/v1/models/{model}/ready")
async def model_ready(model: str, request: Request) -> JSONResponse:
    """Per-model readiness: a worker of `model` with a fresh heartbeat and a recent successful probe."""
    _dispatcher(request).check_model(model)
    ok, details = _health(request).model_readiness(model)
    return JSONResponse(details, status_code=200 if ok else 503)


def _model_info(request: Request, name: str) -> ModelInfo:
    spec = CATALOGUE[name]
    workers = {w: beat.as_json() for w, beat in _health(request).live_workers(name).items()}
    return ModelInfo(
        name=name,
        description=spec.description,
        input_kind=spec.input_kind,
        output=spec.output,
        config=_settings(request).model_config_for(name),
        live_workers=len(workers),
        workers=workers,
    )


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and _is_ascii_number(declared, max_digits=19) and int(declared) > limit_bytes:
        raise PayloadTooLargeError(f"body of {declared} bytes is over the {limit_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise PayloadTooLargeError(f"body is over the {limit_bytes}-byte limit")
    return bytes(body)


def _header_timeout(value: str | None) -> int | None:
    """X-Request-Timeout-Ms as ms, or None when absent. Raises InvalidInputError (422) unless it is
    ASCII digits between 1 and MAX_TIMEOUT_MS ("²" passes str.isdigit but not int())."""
    if value is None:
        return None
    if not _is_ascii_number(value, max_digits=len(str(MAX_TIMEOUT_MS))) or not 1 <= int(value) <= MAX_TIMEOUT_MS:
        raise InvalidInputError(f"X-Request-Timeout-Ms must be an integer number of ms between 1 and {MAX_TIMEOUT_MS}")
    return int(value)


def _is_ascii_number(value: str, max_digits: int) -> bool:
    """ASCII digits only, at most `max_digits` of them (int() refuses other digits and very long strings)."""
    return value.isascii() and value.isdigit() and len(value) <= max_digits

