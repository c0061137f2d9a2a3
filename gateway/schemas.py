"""Hop 1 (validation): the pydantic bodies of the HTTP API and the per-model input checks.

Everything a client can get wrong is caught here, before anything is enqueued, and raised as
InvalidInputError (422), or 400 for a body that is not JSON at all.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, ValidationError

from gateway.edge import MAX_TIMEOUT_MS, check_text_length
from shared.errors import InputTooLongError, InvalidInputError, PayloadTooLargeError
from shared.models import InputKind, ModelConfig, ModelSpec

# msgpack (shared/protocol.py) carries integers from int64's minimum to uint64's maximum; JSON has no bound.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**64 - 1


class BodyNotJsonError(InvalidInputError):
    """The body could not be parsed as JSON at all (400, not 422)."""

    http_status = 400


class InferRequest(BaseModel):
    """POST /v1/models/{model}/infer: `inputs` holds one value per item, in order."""

    model_config = ConfigDict(extra="forbid")

    inputs: Annotated[list[JsonValue], Field(min_length=1)]
    parameters: dict[str, JsonValue] = Field(default_factory=dict)
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
    output: str
    config: ModelConfig
    live_workers: int
    workers: dict[str, dict[str, JsonValue]]  # worker_id -> its heartbeat record (shared/heartbeat.py), no histograms


class ModelList(BaseModel):
    """GET /v1/models: OpenAI's list shape (`object`, `data`); `models` repeats `data` for
    clients of vramguard's earlier shape."""

    object: Literal["list"] = "list"
    data: list[ModelInfo]
    models: list[ModelInfo]


def parse_infer_request(body: bytes) -> InferRequest:
    """Parse and validate a raw body. Raises BodyNotJsonError (400) or InvalidInputError (422),
    the latter also for an integer the wire cannot carry (outside WIRE_INT_MIN..WIRE_INT_MAX)."""
    try:
        parsed = InferRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise BodyNotJsonError(f"body is not valid JSON: {first['msg']}") from exc
        raise InvalidInputError(_summarise(exc)) from exc
    for i, value in enumerate(parsed.inputs):
        _check_wire_ints(value, f"inputs[{i}]")
    for name, value in parsed.parameters.items():
        _check_wire_ints(value, f"parameters.{name}")
    return parsed


def _check_wire_ints(value: JsonValue, where: str) -> None:
    """Raise InvalidInputError naming `where` for an integer outside the 64-bit range msgpack encodes
    (it would otherwise fail in shared/protocol.py's pack, after validation, as a 500)."""
    if isinstance(value, int) and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        digits = str(value)  # pydantic's JSON parser stops at ~4300 digits, below str()'s limit
        shown = digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"
        raise InvalidInputError(
            f"{where}: integer {shown} is outside the range the gateway can carry "
            f"({WIRE_INT_MIN} to {WIRE_INT_MAX}); send it as a string or a float"
        )
    if isinstance(value, list):
        for item in value:
            _check_wire_ints(item, where)
    elif isinstance(value, dict):
        for item in value.values():
            _check_wire_ints(item, where)


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


def validate_inputs(spec: ModelSpec, inputs: list[JsonValue], *, truncate: bool = False) -> list[JsonValue]:
    """Check each input against the model's declared kind; return the inputs to enqueue.
    Raises InvalidInputError naming the index (InputTooLongError, 413, past the length policy).

    text: a string with a visible character, within the model's window (gateway/edge.py's
        check_text_length; cut to it when `truncate`).
    json: any JSON value whose numbers are finite.
    """
    out: list[JsonValue] = []
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
                                    f"{spec.max_input_tokens}-token window holds besides [CLS] and [SEP]")
        out.append(ids[:limit])
    return out


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
