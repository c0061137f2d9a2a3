"""Hop 1: thin HTTP handlers. They parse, call the Dispatcher or Health, and render; every
error is raised as a VramguardError and rendered by app.py's handlers."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse

from gateway.dispatch import Dispatcher
from gateway.health import Health
from gateway.schemas import InferResponse, ModelInfo, ModelList, jsonable, parse_infer_request, validate_inputs
from shared.errors import InvalidInputError, PayloadTooLargeError
from shared.metrics import HISTOGRAM_FIELD
from shared.models import CATALOGUE
from shared.settings import Settings

router = APIRouter()


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
    """Run `inputs` through `model`; one output per input, in order."""
    dispatcher = _dispatcher(request)
    dispatcher.check_model(model)
    with request.app.state.metrics.track(model) as record:  # issue 5: counts, latency, one log line
        body = await _read_body(request, _settings(request).max_body_bytes)
        parsed = parse_infer_request(body)
        validate_inputs(CATALOGUE[model], parsed.inputs)
        timeout_ms = parsed.timeout_ms or _header_timeout(x_request_timeout_ms)
        request_id, reply = await dispatcher.submit(model, list(parsed.inputs), dict(parsed.parameters), timeout_ms)
        record.request_id, record.reply = request_id, reply
    return InferResponse(model=model, request_id=request_id, outputs=[jsonable(v) for v in reply.outputs or []])


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The served models with their batching settings and live workers."""
    return ModelList(models=[_model_info(request, name) for name in _settings(request).served_models])


@router.get("/v1/models/{model}", response_model=ModelInfo)
async def get_model(model: str, request: Request) -> ModelInfo:
    _dispatcher(request).check_model(model)
    return _model_info(request, model)


@router.get("/health/live")
async def live() -> dict[str, str]:
    """Liveness: the gateway process answers."""
    return {"status": "live"}


@router.get("/health/ready")
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
    workers = {w: {k: v for k, v in beat.items() if k != HISTOGRAM_FIELD}  # histograms: /metrics only
               for w, beat in _health(request).live_workers(name).items()}
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
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLargeError(f"body of {declared} bytes is over the {limit_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise PayloadTooLargeError(f"body is over the {limit_bytes}-byte limit")
    return bytes(body)


def _header_timeout(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 3_600_000:
        raise InvalidInputError("X-Request-Timeout-Ms must be an integer number of ms between 1 and 3600000")
    return int(value)

