"""OpenAI-compatible `POST /v1/embeddings`, as the `openai` Python client speaks it. A thin
adapter: the body becomes native inputs (strings or token-id lists) and runs through
gateway/inference.py like any other request (same queue, deadlines, metrics, statuses).

Differences from OpenAI's API, on purpose: token ids are the served model's own vocabulary (not
tiktoken's); `usage` counts the tokens the model ran, [CLS] and [SEP] included; `dimensions` is
refused unless it is the model's own size; an input past the model's window is 413
`input_too_long` (OpenAI answers 400) unless the body sets `"truncate": true` (an extension,
sent with the client's `extra_body`). Errors use OpenAI's shape with our `code` and `request_id`.
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Header, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictBool, StrictInt, StrictStr, ValidationError

from vramguard.gateway.edge.checks import JSON, BadBodyError, header_timeout, read_body, require_media_type
from vramguard.gateway.inference import body_checks, check_json_cost, inference_request, settings_of, submit
from vramguard.gateway.protocols.chat_schema import telling_error
from vramguard.gateway.protocols.openapi import error_responses, request_body
from vramguard.gateway.protocols.render import FastJSONResponse
from vramguard.gateway.protocols.schemas import check_wire_ints, json_fault
from vramguard.shared.errors import InvalidInputError, PayloadTooLargeError, VramguardError
from vramguard.shared.models import InputKind

PATH = "/v1/embeddings"
TOKEN_ID_ADVICE = "a token id is an index into the model's vocabulary, far below that"

router = APIRouter(tags=["openai"])

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class EmbeddingsRequest(BaseModel):
    """The body of POST /v1/embeddings (OpenAI's, plus `truncate`)."""

    model_config = ConfigDict(extra="forbid")

    input: StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    model: StrictStr
    encoding_format: Literal["float", "base64"] | None = None  # null, OpenAI's default: float
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    truncate: StrictBool = False  # "yes" or 1 is refused, as the native route refuses them


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str
    request_id: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


@router.post(PATH, response_model=EmbeddingsResponse, openapi_extra=request_body(EmbeddingsRequest),
             responses=error_responses((400, 401, 404, 413, 415, 429, 500, 503, 504), OpenAIError))
async def embeddings(
    request: Request, x_request_timeout_ms: Annotated[str | None, Header()] = None
) -> Response:
    """One embedding per input, in order, as floats or base64 of little-endian float32.
    X-Request-Timeout-Ms sets the deadline, as on the native route."""
    with body_checks(request):
        timeout_ms = header_timeout(x_request_timeout_ms)
        require_media_type(request, {JSON})
        raw = await read_body(request, settings_of(request).max_body_bytes)
        await check_json_cost(request, raw)
        body = _parse(raw)
    with inference_request(request, body.model) as record:
        spec = settings_of(request).spec_for(body.model)
        if spec.input_kind is not InputKind.TEXT or not spec.outputs:
            raise BadBodyError(f"model {body.model!r} is not a text embedding model")
        width = spec.outputs[0].shape[-1]
        if body.dimensions is not None and body.dimensions != width:
            raise BadBodyError(f"dimensions: model {body.model!r} returns {width} dimensions and cannot shorten them")
        inputs = _inputs(body)
        parameters: dict[str, JsonValue] = {"truncate": True} if body.truncate else {}
        try:
            for i, value in enumerate(inputs):  # a token id past 64 bits: refused here, not a 500 at pack
                check_wire_ints(value, f"inputs[{i}]", TOKEN_ID_ADVICE)
            reply = await submit(request, record, inputs, parameters, timeout_ms,
                                 token_ids=not isinstance(inputs[0], str))
        except (InvalidInputError, PayloadTooLargeError) as exc:
            raise in_openai_terms(exc, one_input=isinstance(body.input, str) or _is_token_list(body.input)) from exc
    # EmbeddingsResponse's shape, written from the reply's arrays directly (gateway/protocols/render.py):
    # 0.44 against 1.06 ms per 32 x 384 reply through the pydantic model (in process, 200 requests).
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(reply.outputs or [])]
    usage = {"prompt_tokens": reply.cost, "total_tokens": reply.cost}
    return FastJSONResponse({"object": "list", "data": data, "model": body.model, "usage": usage})


def _parse(raw: bytes) -> EmbeddingsRequest:
    try:
        return EmbeddingsRequest.model_validate_json(raw)
    except ValidationError as exc:
        first = telling_error(exc.errors())
        if first["type"] == "json_invalid":
            raise BadBodyError(f"body is not valid JSON: {json_fault(first['msg'])}") from exc
        where = ".".join(str(p) for p in first["loc"][:1]) or "body"
        raise InvalidInputError(f"{where}: {first['msg']}") from exc


# The native request's terms in the messages of the shared checks and the worker, and what an
# OpenAI request calls the same thing: its inputs are `input` and its switch a top-level `truncate`.
_OPENAI_TERMS = (
    (re.compile(r"\bparameters\.truncate=true\b"), '"truncate": true in the body'),
    # The field, not a count's noun: "300 inputs in one request" stays plural.
    (re.compile(r"(?<!\d )\binputs\b"), "input"),
)


def in_openai_terms(exc: VramguardError, *, one_input: bool) -> VramguardError:
    """`exc` again (same class, code and status) with its message in the OpenAI request's terms:
    `input[i]` (`input` when the body's input is one string or one token list) for `inputs[i]`, and
    the body's `truncate` for `parameters.truncate`."""
    message = exc.message
    for pattern, replacement in _OPENAI_TERMS:
        message = pattern.sub(replacement, message)
    if one_input:
        message = message.replace("input[0]", "input")
    return type(exc)(message, request_id=exc.request_id, detail=exc.detail)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


def _inputs(body: EmbeddingsRequest) -> list[JsonValue]:
    """The four input forms as a list of native inputs: strings, or lists of token ids."""
    value = body.input
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]
    return list(value)  # type: ignore[arg-type]


def _encode(vector: object, encoding_format: str | None) -> np.ndarray | str:
    """One embedding as float32: the array itself (render.json_bytes writes each number as the
    shortest text that reads back as the same float32) or base64 of its little-endian bytes."""
    array = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]{0,80}): ")


def error_body(status: int, code: str, message: str, request_id: str | None,
               param: str | None = None) -> dict[str, object]:
    """OpenAI's error shape: `type` invalid_request_error (4xx) or server_error (5xx); `param`
    the field the error is about (given, else read from the message's head)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    # Invalid-input messages start with the field they are about ("messages.0.role: ..."); one
    # about the whole body ("body is not valid JSON: ...") names none.
    field = _FIELD.match(message) if status in (400, 422) and param is None else None
    param = field.group(1) if field else param
    return {"error": {"message": message, "type": kind, "param": param, "code": code, "request_id": request_id}}
