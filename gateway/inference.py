"""The one inference path every protocol's route goes through (native, KServe v2, OpenAI):
request id, metrics, the shared input checks, then the Dispatcher. A protocol module only
translates its body into (inputs, parameters, timeout) and the reply back into its own shape."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

from fastapi import Request
from pydantic import JsonValue

from vramguard.gateway.admission.dispatch import Dispatcher
from vramguard.gateway.edge.bodycost import JsonCounter
from vramguard.gateway.edge.checks import ClientGoneError, check_parameters
from vramguard.gateway.edge.disconnect import unless_disconnected
from vramguard.gateway.observe.metrics import RequestRecord
from vramguard.gateway.protocols.schemas import check_blob, check_input_count, validate_inputs, validate_token_inputs
from vramguard.shared.errors import InvalidInputError, VramguardError
from vramguard.shared.models import InputKind, ModelSpec
from vramguard.shared.protocol import ReplyMessage, RequestId, new_request_id
from vramguard.shared.settings import Settings
from vramguard.shared.tracing import server_span

# The `model` label of a request to a model not served here, or refused before its body named one:
# one series, whatever string the client sent (a label value per made-up name would grow without bound).
UNSERVED_MODEL = ""


def dispatcher_of(request: Request) -> Dispatcher:
    return request.app.state.dispatcher  # type: ignore[no-any-return]


def settings_of(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def check_json_cost(request: Request, body: bytes) -> None:
    """PayloadTooLargeError (413) for a JSON body of more values than the event loop may parse
    (gateway/edge/bodycost.py); counted off the loop."""
    counter: JsonCounter = request.app.state.json_counter
    await counter.check(body)


def request_id_of(request: Request) -> RequestId:
    """The id of this inference request (32 hex digits), assigned by the first call: each inference
    route makes that call its first step, ahead of the API key check, so that every error of the
    request carries the id (app.py's handlers read `request.state.request_id`), a 401 and the
    errors found before the body names the model included."""
    # The scope's "state" dict is what `request.state` wraps; read directly, a request without an id
    # yet costs a dict lookup, not the AttributeError that getattr(request.state, ...) raises inside.
    state: dict[str, object] = request.scope.setdefault("state", {})
    request_id = state.get("request_id")
    if request_id is None:
        request_id = state["request_id"] = new_request_id()
    return cast(RequestId, request_id)


@contextmanager
def inference_request(request: Request, model: str) -> Iterator[RequestRecord]:
    """Count, time and log the request under its outcome and its id (`request_id_of`;
    gateway/observe/metrics.py), under the request's trace span when tracing is on (shared/tracing.py:
    continuing the client's `traceparent`); a model this gateway does not serve is its 404
    (ModelNotFoundError), counted under the `model` label UNSERVED_MODEL."""
    request_id = request_id_of(request)
    label = model if model in settings_of(request).served_models else UNSERVED_MODEL
    with request.app.state.metrics.track(label) as record, server_span(request.headers, label, request_id):
        record.request_id = request_id
        dispatcher_of(request).check_model(model)
        yield record


@contextmanager
def body_checks(request: Request) -> Iterator[None]:
    """The checks a route makes before its body names the model (media type, size, JSON, fields): a
    refusal (VramguardError) is counted, timed and logged under model UNSERVED_MODEL and its code.
    Nothing is counted when they pass: `inference_request` counts the request from there."""
    request_id = request_id_of(request)
    started = time.perf_counter()
    try:
        yield
    except VramguardError as exc:
        request.app.state.metrics.refused(UNSERVED_MODEL, exc, request_id, time.perf_counter() - started)
        raise


async def submit(
    request: Request,
    record: RequestRecord,
    inputs: Sequence[object],
    parameters: dict[str, JsonValue],
    timeout_ms: int | None,
    *,
    token_ids: bool = False,
    raw: bool = False,
) -> ReplyMessage:
    """Check inputs and parameters against the model's catalogue entry (built-in or from the models
    file) and settings, then run them. `token_ids`: the inputs are lists of token ids for a text
    model (the OpenAI route's forms). `raw`: the inputs are blobs (bytes) of a bytes model, as a
    raw body or v2 binary BYTES elements carry them; otherwise they are JSON values.

    Raises PayloadTooLargeError (too many inputs), InvalidInputError (unknown parameter, bad
    input), InputTooLongError (over the window without parameters.truncate), or whatever the
    Dispatcher raises (429, 503, 504, the worker's error).
    """
    model = record.model
    spec = settings_of(request).spec_for(model)
    check_input_count(model, dispatcher_of(request).config_for(model), len(inputs))
    check_parameters(spec, parameters)
    truncate = parameters.get("truncate") is True
    prepared: list[object]
    if raw:
        prepared = [_blob(spec, i, value) for i, value in enumerate(inputs)]
    elif token_ids:
        prepared = list(validate_token_inputs(spec, _json(inputs), truncate=truncate))
    else:
        prepared = validate_inputs(spec, _json(inputs), truncate=truncate)
    dispatcher, request_id = dispatcher_of(request), RequestId(str(record.request_id))
    try:
        _, reply = await unless_disconnected(
            request, dispatcher.submit(model, list(prepared), dict(parameters), timeout_ms, request_id=request_id))
    except ClientGoneError:
        # Its worker acks it without computing it if its batch has not run yet (worker/batch/serve.py).
        await dispatcher.close_stream(model, request_id, cancel=True)
        raise
    record.reply = reply
    return reply


def _json(inputs: Sequence[object]) -> list[JsonValue]:
    return cast(list[JsonValue], list(inputs))  # every route but the raw ones parses inputs from JSON


def _blob(spec: ModelSpec, index: int, value: object) -> bytes:
    """One raw input: bytes for a bytes model (check_blob), else InvalidInputError."""
    if spec.input_kind is not InputKind.BYTES or not isinstance(value, bytes):
        raise InvalidInputError(f"inputs[{index}]: model {spec.name!r} takes {spec.input_kind} inputs, not raw bytes")
    check_blob(spec, value, index)
    return value
