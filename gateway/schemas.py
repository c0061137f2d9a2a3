"""Hop 1 (validation): the pydantic bodies of the HTTP API and the per-model input checks.

Everything a client can get wrong is caught here, before anything is enqueued, and raised as
InvalidInputError (422), or 400 for a body that is not JSON at all.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from shared.errors import InvalidInputError
from shared.models import InputKind, ModelConfig, ModelSpec

MAX_TEXT_CHARS = 100_000  # per input; minilm truncates to its 256-token window anyway


class BodyNotJsonError(InvalidInputError):
    """The body could not be parsed as JSON at all (400, not 422)."""

    http_status = 400


class InferRequest(BaseModel):
    """POST /v1/models/{model}/infer: `inputs` holds one value per item, in order."""

    model_config = ConfigDict(extra="forbid")

    inputs: Annotated[list[JsonValue], Field(min_length=1)]
    parameters: dict[str, JsonValue] = Field(default_factory=dict)
    timeout_ms: Annotated[int | None, Field(ge=1, le=3_600_000)] = None


class InferResponse(BaseModel):
    model: str
    request_id: str
    outputs: list[JsonValue]


class ModelInfo(BaseModel):
    """GET /v1/models/{model}: the catalogue entry, its batching settings and its live workers."""

    name: str
    description: str
    input_kind: InputKind
    output: str
    config: ModelConfig
    live_workers: int
    workers: dict[str, dict[str, str]]


class ModelList(BaseModel):
    models: list[ModelInfo]


def parse_infer_request(body: bytes) -> InferRequest:
    """Parse and validate a raw body. Raises BodyNotJsonError (400) or InvalidInputError (422)."""
    try:
        return InferRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise BodyNotJsonError(f"body is not valid JSON: {first['msg']}") from exc
        raise InvalidInputError(_summarise(exc)) from exc


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def validate_inputs(spec: ModelSpec, inputs: list[JsonValue]) -> None:
    """Check each input against the model's declared kind. Raises InvalidInputError naming the index.

    text: a non-blank string of at most MAX_TEXT_CHARS characters.
    json: any JSON value whose numbers are finite.
    """
    for i, value in enumerate(inputs):
        if spec.input_kind is InputKind.TEXT:
            if not isinstance(value, str):
                raise InvalidInputError(f"inputs[{i}]: model {spec.name!r} takes strings, got {type(value).__name__}")
            if not value.strip():
                raise InvalidInputError(f"inputs[{i}]: empty string")
            if len(value) > MAX_TEXT_CHARS:
                raise InvalidInputError(f"inputs[{i}]: {len(value)} characters, more than {MAX_TEXT_CHARS}")
        elif not _all_finite(value):
            raise InvalidInputError(f"inputs[{i}]: contains a non-finite number")


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
