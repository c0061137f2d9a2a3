"""Hop 1 (validation): the pydantic bodies of the HTTP API and the per-model input checks.

Everything a client can get wrong is caught here, before anything is enqueued, and raised as
InvalidInputError (422), or 400 for a body that is not JSON at all.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, StrictInt, ValidationError

from vramguard.gateway.edge.checks import MAX_TIMEOUT_MS, check_text_length
from vramguard.shared.errors import InputTooLongError, InvalidInputError, PayloadTooLargeError
from vramguard.shared.models import InputKind, ModelConfig, ModelSpec, OutputSpec, ParameterSpec

# msgpack (shared/protocol.py) carries integers from int64's minimum to uint64's maximum; JSON has no bound.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


class BodyNotJsonError(InvalidInputError):
    """The body could not be parsed as JSON at all (400, not 422)."""

    http_status = 400


def _null_is_none_given(value: object) -> object:
    return {} if value is None else value


# A `parameters` object; `null` reads as none given, as `"timeout_ms": null` does: clients that
# serialise every field of a request object send null for the ones left unset. The schema says null
# is taken (json_schema_input_type: pydantic >= 2.10).
Parameters = Annotated[dict[str, JsonValue],
                       BeforeValidator(_null_is_none_given, json_schema_input_type=dict[str, JsonValue] | None)]


class InferRequest(BaseModel):
    """POST /v1/models/{model}/infer: `inputs` holds one value per item, in order."""

    model_config = ConfigDict(extra="forbid")

    inputs: Annotated[list[JsonValue], Field(min_length=1)]
    parameters: Parameters = Field(default_factory=dict)
    timeout_ms: Annotated[StrictInt | None, Field(ge=1, le=MAX_TIMEOUT_MS)] = None  # 100.0, "100", true: 422


class InferResponse(BaseModel):
    model: str
    request_id: str
    outputs: list[JsonValue]


class ModelInfo(BaseModel):
    """GET /v1/models/{model}: the catalogue entry, its batching settings and its live workers,
    with OpenAI's model fields (`id`, `object`, `created`, `owned_by`) first."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0  # OpenAI's creation time (epoch s); catalogue models have none
    owned_by: str = "vramguard"
    name: str
    description: str
    input_kind: InputKind
    output: OutputSpec
    parameters: dict[str, ParameterSpec]  # what `parameters` may carry (any other name is 422)
    example: tuple[JsonValue, ...] | None  # a sample `inputs` list (the models file's `example`)
    config: ModelConfig
    live_workers: int
    workers: dict[str, dict[str, JsonValue]]  # worker_id -> its heartbeat record (shared/heartbeat.py), no histograms


class ModelList(BaseModel):
    """GET /v1/models: OpenAI's list shape (`object`, `data`); `models` repeats `data` for
    clients of vramguard's earlier shape."""

    object: Literal["list"] = "list"
    data: list[ModelInfo]
    models: list[ModelInfo]


def json_fault(detail: str) -> str:
    """The JSON parser's complaint (line and column kept) as a client can act on it: without
    pydantic's "Invalid JSON: " prefix, and with what a UTF-16 surrogate escape that is not half of
    a pair (`"\\ud800"`, which no tokenizer can encode) means, which the parser's "unexpected end
    of hex escape" does not say."""
    detail = detail.removeprefix("Invalid JSON: ")
    if "surrogate" in detail or "end of hex escape" in detail:
        detail += (" (a \\uD800-\\uDFFF escape must be one half of a surrogate pair; a lone one is not text: "
                   "send the character itself in UTF-8, or its pair of escapes)")
    return detail


def parse_infer_request(body: bytes) -> InferRequest:
    """Parse and validate a raw body. Raises BodyNotJsonError (400) or InvalidInputError (422),
    the latter also for an integer the wire cannot carry (outside WIRE_INT_MIN..WIRE_INT_MAX)."""
    try:
        parsed = InferRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise BodyNotJsonError(f"body is not valid JSON: {json_fault(first['msg'])}") from exc
        raise InvalidInputError(_summarise(exc)) from exc
    for i, value in enumerate(parsed.inputs):
        check_wire_ints(value, f"inputs[{i}]")
    for name, value in parsed.parameters.items():
        check_wire_ints(value, f"parameters.{name}")
    return parsed


def check_wire_ints(value: JsonValue, where: str, advice: str = "send it as a string or a float") -> None:
    """Raise InvalidInputError naming `where` for an integer outside the 64-bit range msgpack encodes
    (it would otherwise fail in shared/protocol.py's pack, after validation, as a 500). `advice` ends
    the message: what the client can send instead, which depends on what the integer stands for."""
    if isinstance(value, int) and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        digits = str(value)  # pydantic's JSON parser stops at ~4300 digits, below str()'s limit
        shown = digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"
        raise InvalidInputError(
            f"{where}: integer {shown} is outside the range the gateway can carry "
            f"({WIRE_INT_MIN} to {WIRE_INT_MAX}); {advice}"
        )
    if isinstance(value, list):
        for item in value:
            check_wire_ints(item, where, advice)
    elif isinstance(value, dict):
        for item in value.values():
            check_wire_ints(item, where, advice)


def check_input_count(model: str, config: ModelConfig, n_inputs: int) -> None:
    """Raise PayloadTooLargeError (413) when a request carries more than `config.max_inputs_per_request`
    inputs (Settings' per-model value), naming both numbers."""
    if n_inputs > config.max_inputs_per_request:
        raise PayloadTooLargeError(
            f"{n_inputs} inputs in one request; model {model!r} takes at most {config.max_inputs_per_request}"
        )


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def validate_inputs(spec: ModelSpec, inputs: list[JsonValue], *, truncate: bool = False) -> list[object]:
    """Check each input against the model's declared kind; return the inputs as they travel to the
    worker. Raises InvalidInputError (422) naming the index; PayloadTooLargeError (413) past
    spec.max_input_bytes, InputTooLongError (413) past the length policy.

    text: a string with a visible character, within the model's window (gateway/edge/checks.py's
        check_text_length; cut to it when `truncate`).
    json: any JSON value whose numbers are finite.
    bytes: a base64 string (RFC 4648, padded) of 1 to spec.max_input_bytes bytes, sent on as
        bytes (msgpack binary: never base64 inside msgpack).
    """
    if spec.input_kind is InputKind.BYTES:
        return [decode_base64_input(spec, value, i) for i, value in enumerate(inputs)]
    out: list[object] = []
    for i, value in enumerate(inputs):
        if spec.input_kind is InputKind.TEXT:
            if not isinstance(value, str):
                raise InvalidInputError(f"inputs[{i}]: model {spec.name!r} takes strings, got {type(value).__name__}")
            value = check_text_length(spec, i, value, truncate)
        elif not _all_finite(value):
            raise InvalidInputError(f"inputs[{i}]: contains a non-finite number")
        out.append(value)
    return out


def validate_token_inputs(spec: ModelSpec, inputs: list[JsonValue], *, truncate: bool) -> list[JsonValue]:
    """Token-id inputs of a text model: each a non-empty list of non-negative integers (the worker
    checks them against its vocabulary), at most the window less [CLS] and [SEP]. Longer: cut
    there when `truncate`, else InputTooLongError (413) naming the count and the limit."""
    if spec.input_kind is not InputKind.TEXT or spec.max_input_tokens is None:
        raise InvalidInputError(f"model {spec.name!r} does not take token ids")
    limit = spec.max_input_tokens - 2
    out: list[JsonValue] = []
    for i, ids in enumerate(inputs):
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise InvalidInputError(f"inputs[{i}]: a token-id input is a non-empty list of non-negative integers")
        if len(ids) > limit and not truncate:
            raise InputTooLongError(f"inputs[{i}]: {len(ids)} tokens, more than the {limit} the model's "
                                    f"{spec.max_input_tokens}-token window holds besides [CLS] and [SEP]; "
                                    f"{InputTooLongError.HINT}")
        out.append(ids[:limit])
    return out


def decode_base64_input(spec: ModelSpec, value: JsonValue, index: int) -> bytes:
    """inputs[index] of a bytes model: base64 text -> its bytes, checked by check_blob."""
    if not isinstance(value, str):
        raise InvalidInputError(f"inputs[{index}]: model {spec.name!r} takes base64 strings, "
                                f"got {type(value).__name__}")
    if len(value) > (spec.max_input_bytes + 2) // 3 * 4 + 4:  # refuse before decoding a huge string
        raise PayloadTooLargeError(f"inputs[{index}]: more than the model's {spec.max_input_bytes} bytes")
    try:
        blob = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"inputs[{index}]: not valid base64 (standard alphabet, padded)") from None
    check_blob(spec, blob, index)
    return blob


def check_blob(spec: ModelSpec, blob: bytes, index: int = 0) -> None:
    """Raise InvalidInputError for an empty blob, PayloadTooLargeError past spec.max_input_bytes."""
    if not blob:
        raise InvalidInputError(f"inputs[{index}]: empty")
    if len(blob) > spec.max_input_bytes:
        raise PayloadTooLargeError(f"inputs[{index}]: {len(blob)} bytes, more than the model's {spec.max_input_bytes}")


def query_parameters(query: Mapping[str, str]) -> dict[str, JsonValue]:
    """A raw-body request's `parameters`, from its query string: each value read as a JSON scalar
    when it is one (`top_k=3` -> 3, `logits=true` -> true), else kept as text."""
    params: dict[str, JsonValue] = {}
    for name, text in query.items():
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        params[name] = value if isinstance(value, str | int | float | bool) and _all_finite(value) else text
    return params


def _all_finite(value: JsonValue) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_all_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    return True


def jsonable(value: object) -> JsonValue:
    """A reply value as JSON: numpy arrays (float32 embeddings, echoed tensors) become nested lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()  # type: ignore[no-any-return]
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        raise TypeError("bytes outputs cannot be rendered as JSON")
    return value  # type: ignore[return-value]
