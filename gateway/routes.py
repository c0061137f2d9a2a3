"""Hop 1: thin HTTP handlers. They parse, call the Dispatcher or Health, and render; every
error is raised as a VramguardError and rendered by app.py's handlers. `router` holds the
`/v1/...` routes, behind the API key when one is set; `health_router` stays open for probes."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import JsonValue
from starlette.datastructures import Headers

from vramguard.gateway.edge.checks import JSON, header_timeout, read_body, require_media_type
from vramguard.gateway.inference import (
    check_json_cost,
    dispatcher_of,
    inference_request,
    request_id_of,
    settings_of,
    submit,
)
from vramguard.gateway.observe.health import Health
from vramguard.gateway.protocols.openapi import NATIVE_ERRORS, error_responses, request_body
from vramguard.gateway.protocols.render import FastJSONResponse
from vramguard.gateway.protocols.schemas import (
    InferRequest,
    InferResponse,
    ModelInfo,
    ModelList,
    check_wire_ints,
    parse_infer_request,
    query_parameters,
)
from vramguard.shared.errors import UnauthorizedError


async def require_api_key(request: Request) -> None:
    """When `Settings.api_key` is set, the request must carry it as `Authorization: Bearer <key>` or
    `X-API-Key: <key>`; else UnauthorizedError (401). Compared in constant time. A coroutine
    although it never awaits: FastAPI runs a plain `def` dependency in its thread pool, a thread
    hop per request."""
    if settings_of(request).api_key is not None and not has_api_key(request):
        raise UnauthorizedError("missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")


def has_api_key(request: Request) -> bool:
    """Whether the request carries `Settings.api_key` (False when none is set: then nothing is
    behind a key). Open routes show internal detail (Redis' error text) only to such a request."""
    key = settings_of(request).api_key
    if key is None:
        return False
    expected = key.get_secret_value().encode()
    # Header values arrive as latin-1 text (ASGI); back to their bytes, as the client sent them.
    return any(secrets.compare_digest(given.encode("latin-1"), expected) for given in _presented_keys(request.headers))


async def assign_request_id(request: Request) -> None:
    """`request_id_of` as a FastAPI dependency, listed ahead of `require_api_key`. A coroutine for
    the reason `require_api_key` gives."""
    request_id_of(request)


def _presented_keys(headers: Headers) -> list[str]:
    keys = headers.getlist("x-api-key")
    for value in headers.getlist("authorization"):
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer":
            keys.append(token.strip())
    return keys


router = APIRouter(dependencies=[Depends(require_api_key)])
health_router = APIRouter()


def _health(request: Request) -> Health:
    return request.app.state.health  # type: ignore[no-any-return]


INFER_PATH = "/v1/models/{model}/infer"


@router.post(
    INFER_PATH,
    response_model=InferResponse,
    openapi_extra=request_body(InferRequest),
    responses=error_responses(NATIVE_ERRORS),
)
async def infer(
    model: str,
    request: Request,
    x_request_timeout_ms: Annotated[str | None, Header()] = None,
) -> Response:
    """Run `inputs` through `model`; one output per input, in order. The body must be
    application/json (optionally gzip-encoded); `parameters` takes only what the model declares.
    A bytes model also takes one raw input as the body when its Content-Type is one of the
    model's `raw_content_types`; `parameters` then come from the query string."""
    return await _infer(model, request, x_request_timeout_ms)


async def infer_endpoint(request: Request) -> Response:
    """`infer` as a plain Starlette endpoint: what serves POST /v1/models/{model}/infer. app.py
    routes the path here ahead of the FastAPI route above, which stays for the OpenAPI schema.
    FastAPI's per-request machinery (included-router matching, dependency solving, parameter
    validation) was about a fifth of the gateway's CPU per request on the hottest route (py-spy,
    concurrency 64, instant workers; served here, the gateway's CPU per request fell to 0.78x,
    the median of 5 alternating rounds); this does the same checks by hand: the API key, the
    path's model, the X-Request-Timeout-Ms header (a string, parsed by edge.header_timeout)."""
    request_id_of(request)
    await require_api_key(request)
    return await _infer(request.path_params["model"], request, request.headers.get("x-request-timeout-ms"))


async def _infer(model: str, request: Request, x_request_timeout_ms: str | None) -> Response:
    with inference_request(request, model) as record:
        header_ms = header_timeout(x_request_timeout_ms)  # checked even when the body wins
        spec = settings_of(request).spec_for(model)
        require_media_type(request, {JSON, *spec.raw_content_types})
        body = await read_body(request, settings_of(request).max_body_bytes)
        if _media_type(request) in spec.raw_content_types:
            reply = await submit(request, record, *_raw_request(body, request), header_ms, raw=True)
        else:
            await check_json_cost(request, body)
            parsed = parse_infer_request(body)
            reply = await submit(request, record, list(parsed.inputs), dict(parsed.parameters),
                                 parsed.timeout_ms or header_ms)
    # InferResponse's shape, written from the reply's arrays directly (gateway/protocols/render.py).
    return FastJSONResponse({"model": model, "request_id": str(record.request_id), "outputs": reply.outputs or []})


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The served models with their batching settings and live workers."""
    models = [_model_info(request, name) for name in settings_of(request).served_models]
    return ModelList(data=models, models=models)


@router.get("/v1/models/{model}", response_model=ModelInfo)
async def get_model(model: str, request: Request) -> ModelInfo:
    dispatcher_of(request).check_model(model)
    return _model_info(request, model)


@health_router.get("/health/live")  # and HEAD, as every GET route (gateway/protocols/native.py)
async def live() -> dict[str, str]:
    """Liveness: the gateway process answers."""
    return {"status": "live"}


@health_router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: this gateway can serve (gateway/observe/health.py: Redis answers, its tasks run, a served
    model has a live worker); else 503 with the reasons. Redis' own error text only with the API key."""
    ok, details = _health(request).readiness(detail=has_api_key(request))
    return JSONResponse(details, status_code=200 if ok else 503)


@router.get("/v1/models/{model}/ready")
async def model_ready(model: str, request: Request) -> JSONResponse:
    """Per-model readiness: a worker of `model` with a fresh heartbeat and a recent successful probe."""
    dispatcher_of(request).check_model(model)
    ok, details = _health(request).model_readiness(model, detail=has_api_key(request))
    return JSONResponse(details, status_code=200 if ok else 503)


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


def _raw_request(body: bytes, request: Request) -> tuple[list[object], dict[str, JsonValue]]:
    """A raw-body request to a bytes model (Content-Type in spec.raw_content_types): (inputs, parameters):
    the body is the one input, `parameters` come from the query string, the deadline only from
    X-Request-Timeout-Ms (the blob itself is checked by inference.submit). Raises InvalidInputError."""
    parameters = query_parameters(request.query_params)
    for name, value in parameters.items():
        check_wire_ints(value, f"parameters.{name}")
    return [body], parameters


def _model_info(request: Request, name: str) -> ModelInfo:
    spec = settings_of(request).spec_for(name)
    workers = {w: beat.as_json() for w, beat in _health(request).live_workers(name).items()}
    return ModelInfo(
        id=name,
        name=name,
        description=spec.description,
        input_kind=spec.input_kind,
        output=spec.output,
        parameters=spec.parameters,
        example=spec.example,
        config=settings_of(request).model_config_for(name),
        live_workers=len(workers),
        workers=workers,
    )
