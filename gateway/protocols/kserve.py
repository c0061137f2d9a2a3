"""KServe Open Inference Protocol v2 (REST), as Triton's `tritonclient[http]` speaks it: server and
model metadata, liveness and readiness, and inference with JSON tensors or the binary tensor data
extension in both directions. A thin adapter: tensors become the native inputs and parameters,
and the request runs through gateway/inference.py like any other (same queue, deadlines, metrics).

A model's tensors come from its catalogue entry (shared/models.py: `inputs`, `outputs`): one
input and one output, the first dimension being the batch (one row per item). Errors are
`{"error": "<message>"}` (app.py renders them for /v2 paths); every invalid request is 400, as in Triton.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, ValidationError

from vramguard.gateway.edge.checks import (
    JSON,
    MAX_TIMEOUT_MS,
    BadBodyError,
    is_ascii_number,
    read_body,
    require_media_type,
)
from vramguard.gateway.inference import check_json_cost, dispatcher_of, inference_request, settings_of, submit
from vramguard.gateway.protocols.openapi import error_responses, request_body
from vramguard.gateway.protocols.render import FastJSONResponse
from vramguard.gateway.protocols.schemas import Parameters, check_wire_ints, json_fault, jsonable
from vramguard.gateway.routes import has_api_key
from vramguard.shared.errors import InvalidInputError, ModelNotFoundError, PayloadTooLargeError
from vramguard.shared.models import InputKind, ModelSpec, TensorSpec

OCTET = "application/octet-stream"
HEADER_LENGTH = "inference-header-content-length"
# Request parameters of the protocol itself (tritonclient sends them); the rest must be the model's.
PROTOCOL_PARAMETERS = frozenset({"binary_data_output", "timeout", "priority"})
DTYPES = {"BOOL": "?", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "<i1",
          "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
MODEL_VERSION = "1"
# Bounds on what a client's tensor header may say, checked while parsing so that no step costs more
# than linear time in the body (a product of thousands of huge dimensions is quadratic, and its
# decimal form past 4300 digits raises): dimensions are int64 as in Triton, at most MAX_DIMS of them.
MAX_DIMS = 8
Dimension = Annotated[StrictInt, Field(le=2**63 - 1)]  # the protocol's int64: "1", 1.0 and true are refused

router = APIRouter(tags=["kserve-v2"])  # behind the API key when one is set
health_router = APIRouter(tags=["kserve-v2"])  # open, like /health/*, for probes


class V2Error(BaseModel):
    error: str


class V2Tensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    shape: Annotated[list[Dimension], Field(max_length=MAX_DIMS)]
    datatype: str
    parameters: Parameters = Field(default_factory=dict)
    data: JsonValue = None


class V2Output(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: Parameters = Field(default_factory=dict)


class V2InferRequest(BaseModel):
    """POST /v2/models/{model}/infer: the JSON part of the body (all of it without the binary extension)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    parameters: Parameters = Field(default_factory=dict)
    inputs: Annotated[list[V2Tensor], Field(min_length=1)]
    outputs: list[V2Output] | None = None


V2_ERRORS = error_responses((400, 401, 404, 413, 415, 429, 500, 503, 504), V2Error)


@router.get("/v2")
async def server_metadata() -> dict[str, object]:
    """Server metadata; `extensions` lists the binary tensor data extension."""
    return {"name": "vramguard", "version": "0.1.0", "extensions": ["binary_tensor_data"]}


@health_router.get("/v2/health/live")
async def server_live() -> dict[str, bool]:
    return {"live": True}


@health_router.get("/v2/health/ready", responses=V2_ERRORS)
async def server_ready(request: Request) -> JSONResponse:
    """200 when this gateway can serve (gateway/observe/health.py's readiness), else 503."""
    ok, _details = request.app.state.health.readiness()
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/v2/models/{model}", responses=V2_ERRORS)
@router.get("/v2/models/{model}/versions/{version}", responses=V2_ERRORS, include_in_schema=False)
async def model_metadata(model: str, request: Request, version: str = MODEL_VERSION) -> dict[str, object]:
    """The model's name, version and tensors (shape -1: variable; the first dimension is the batch)."""
    spec = _spec(request, model, version)
    return {"name": model, "versions": [MODEL_VERSION], "platform": "vramguard",
            "inputs": [_tensor_metadata(t) for t in spec.inputs],
            "outputs": [_tensor_metadata(t) for t in spec.outputs]}


@router.get("/v2/models/{model}/ready", responses=V2_ERRORS)
@router.get("/v2/models/{model}/versions/{version}/ready", responses=V2_ERRORS, include_in_schema=False)
async def model_ready(model: str, request: Request, version: str = MODEL_VERSION) -> JSONResponse:
    _spec(request, model, version)
    ok, _details = request.app.state.health.model_readiness(model, detail=has_api_key(request))
    return JSONResponse({"name": model, "ready": ok}, status_code=200 if ok else 503)


@router.post("/v2/models/{model}/infer", responses=V2_ERRORS,
             openapi_extra=request_body(V2InferRequest, ("application/json", OCTET)))
@router.post("/v2/models/{model}/versions/{version}/infer", include_in_schema=False)
async def infer(
    model: str,
    request: Request,
    version: str = MODEL_VERSION,
    inference_header_content_length: Annotated[str | None, Header()] = None,
) -> Response:
    """Inference. Without Inference-Header-Content-Length the body is all JSON; with it, that many
    bytes of JSON followed by the binary tensors named by their `binary_data_size` parameters."""
    with inference_request(request, model) as record:
        spec = _spec(request, model, version)
        if not spec.inputs:  # a model whose catalogue entry declares no v2 tensors (JSON objects out, ...)
            route = ("POST /v1/chat/completions or POST /v1/completions" if spec.options.get("generates")
                     else f"POST /v1/models/{model}/infer")
            raise BadBodyError(f"model {model!r} declares no KServe v2 tensors; use {route}")
        require_media_type(request, {JSON, OCTET}, allow_missing=True)  # tritonclient sends none
        body = await read_body(request, settings_of(request).max_body_bytes)
        json_length = _json_length(body, inference_header_content_length)
        await check_json_cost(request, body[:json_length])
        parsed, binary = _split_body(body, json_length)
        max_rows = dispatcher_of(request).config_for(model).max_inputs_per_request
        inputs = _read_input(spec, parsed.inputs, binary, max_rows)
        _check_outputs(spec, parsed)
        parameters = {k: v for k, v in parsed.parameters.items() if k not in PROTOCOL_PARAMETERS}
        _check_parameter_ints(parameters)
        # A bytes model's binary BYTES elements are its blobs as sent; in JSON they are base64 text.
        raw = bool(inputs) and isinstance(inputs[0], bytes)
        reply = await submit(request, record, inputs, parameters, _timeout_ms(parsed.parameters), raw=raw)
    return _render(model, parsed, spec, reply.outputs or [])


def _spec(request: Request, model: str, version: str) -> ModelSpec:
    dispatcher_of(request).check_model(model)
    if version != MODEL_VERSION:
        raise ModelNotFoundError(f"model {model[:100]!r} has only version {MODEL_VERSION}")
    return settings_of(request).spec_for(model)


def _tensor_metadata(tensor: TensorSpec) -> dict[str, object]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}


def _json_length(body: bytes, header_length: str | None) -> int:
    """The length of the JSON part: Inference-Header-Content-Length, else the whole body. Raises
    BadBodyError (400) for a header that is not a length within the body."""
    if header_length is None:
        return len(body)
    if not is_ascii_number(header_length, max_digits=19) or int(header_length) > len(body):
        raise BadBodyError(f"Inference-Header-Content-Length {header_length[:20]!r} is not a length "
                           f"within the {len(body)}-byte body")
    return int(header_length)


def _split_body(body: bytes, json_length: int) -> tuple[V2InferRequest, bytes]:
    """(the JSON part parsed, the binary rest). Raises BadBodyError (400)."""
    try:
        parsed = V2InferRequest.model_validate_json(body[:json_length])
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise BadBodyError(f"body is not valid JSON: {json_fault(first['msg'])}") from exc
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadBodyError(f"{where}: {first['msg']}") from exc
    return parsed, body[json_length:]


def _read_input(spec: ModelSpec, tensors: list[V2Tensor], binary: bytes, max_rows: int) -> list[object]:
    """The one declared input tensor as native inputs (one per row): JSON values, or bytes for a
    bytes model's binary BYTES elements. The shape is checked before any element is read, and no
    more elements are read than it holds, so a tensor costs at most linear time in its rows.
    Raises BadBodyError naming the tensor: unknown or missing name, wrong datatype, negative
    dimension, shape and data disagree, an element the datatype cannot hold; PayloadTooLargeError
    past `max_rows` (the model's max_inputs_per_request)."""
    declared = spec.inputs[0]
    names = [t.name for t in tensors]
    if names != [declared.name]:
        raise BadBodyError(f"model {spec.name!r} takes one input named {declared.name[:100]!r}, got {names[:8]}")
    tensor = tensors[0]
    if tensor.datatype != declared.datatype:
        raise BadBodyError(f"input {tensor.name!r}: datatype {tensor.datatype[:20]!r}, expected {declared.datatype!r}")
    if not tensor.shape or any(d < 0 for d in tensor.shape):
        raise BadBodyError(f"input {tensor.name!r}: shape {tensor.shape} must be non-empty and non-negative")
    rows, count = tensor.shape[0], math.prod(tensor.shape)  # at most MAX_DIMS int64s: cheap
    if rows == 0 or count != rows:
        raise BadBodyError(f"input {tensor.name!r}: one element per row expected, shape {tensor.shape}")
    if rows > max_rows:
        raise PayloadTooLargeError(f"{rows} inputs in one request; model {spec.name!r} takes at most {max_rows}")
    size = tensor.parameters.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or size != len(binary):  # one input: every byte after the JSON is its
            raise BadBodyError(f"input {tensor.name!r}: binary_data_size {str(size)[:40]} disagrees with the "
                               f"{len(binary)} bytes after the JSON header")
        values = _from_binary(tensor, binary, count, keep_bytes=spec.input_kind is InputKind.BYTES)
    elif tensor.data is None:
        raise BadBodyError(f"input {tensor.name!r}: no data (JSON `data`, or binary data with "
                           "parameters.binary_data_size)")
    else:
        values = _flatten(tensor.data, count)
    if len(values) != count:
        shown = f"{len(values)}" if len(values) <= count else f"more than {count}"
        raise BadBodyError(f"input {tensor.name!r}: shape {tensor.shape} holds {count} elements, data has {shown}")
    return _typed(tensor, values)


def _from_binary(tensor: V2Tensor, raw: bytes, count: int, *, keep_bytes: bool) -> list[object]:
    """The elements of a binary tensor (at most `count` + 1 read): numbers, or BYTES elements as
    UTF-8 text (bytes when `keep_bytes`)."""
    if tensor.datatype != "BYTES":
        itemsize = np.dtype(DTYPES[tensor.datatype]).itemsize
        if len(raw) % itemsize or len(raw) // itemsize != count:
            raise BadBodyError(f"input {tensor.name!r}: {len(raw)} bytes are not {count} {tensor.datatype} elements")
        return np.frombuffer(raw, dtype=DTYPES[tensor.datatype]).tolist()  # type: ignore[no-any-return]
    values: list[object] = []
    offset = 0
    while offset < len(raw) and len(values) <= count:  # each element: 4-byte little-endian length, then the bytes
        if offset + 4 > len(raw):
            raise BadBodyError(f"input {tensor.name!r}: truncated BYTES element length")
        (length,) = struct.unpack_from("<I", raw, offset)
        element = raw[offset + 4 : offset + 4 + length]
        if len(element) != length:
            raise BadBodyError(f"input {tensor.name!r}: BYTES element shorter than its length {length}")
        values.append(element if keep_bytes else _utf8(tensor, element))
        offset += 4 + length
    return values


def _utf8(tensor: V2Tensor, element: bytes) -> str:
    try:
        return element.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadBodyError(f"input {tensor.name!r}: a BYTES element is not UTF-8 text") from exc


def _flatten(data: JsonValue, count: int) -> list[object]:
    """The elements of JSON `data` in row-major order (nested lists flattened; a null is an element,
    which `_typed` refuses, never one silently left out), at most `count` + 1 of them: enough to
    tell that there are too many."""
    values: list[object] = []
    pending: list[JsonValue] = [data]
    while pending and len(values) <= count:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(reversed(item))
        else:
            values.append(item)
    return values


def _typed(tensor: V2Tensor, values: list[object]) -> list[object]:
    """Each element checked against the datatype (JSON data can hold anything): BYTES strings,
    BOOL true/false, INT and UINT integers within the type's range (an integral float such as 2.0
    becomes an int; 2.5 is refused), FP numbers the type can hold (finite, within its range)."""
    kind = tensor.datatype
    if kind == "BYTES":
        if not all(isinstance(v, str | bytes) for v in values):  # bytes: binary elements of a bytes model
            raise BadBodyError(f"input {tensor.name!r}: BYTES elements must be strings")
        return values
    if kind == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise BadBodyError(f"input {tensor.name!r}: BOOL elements must be true or false")
        return values
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise BadBodyError(f"input {tensor.name!r}: {kind} elements must be numbers")
    dtype = np.dtype(DTYPES[kind])
    if dtype.kind in "iu":
        limits = np.iinfo(dtype)
        if not all(float(v).is_integer() if isinstance(v, float) else True for v in values):
            raise BadBodyError(f"input {tensor.name!r}: {kind} elements must be integers")
        integers = [int(v) for v in values]  # type: ignore[call-overload]
        if not all(limits.min <= v <= limits.max for v in integers):
            raise BadBodyError(f"input {tensor.name!r}: {kind} elements must lie in {limits.min}..{limits.max}")
        return list(integers)
    largest = float(np.finfo(dtype).max)  # Python compares a huge int with a float exactly, without overflow
    if not all(-largest <= v <= largest for v in values):  # type: ignore[operator]  # also refuses nan and inf
        raise BadBodyError(f"input {tensor.name!r}: {kind} elements must be finite numbers within its range")
    return [float(v) for v in values]  # type: ignore[arg-type]  # an integral JSON number of 300 digits too


def _timeout_ms(parameters: dict[str, JsonValue]) -> int | None:
    """Triton's `timeout` request parameter is in microseconds; None when absent."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadBodyError("parameters.timeout: a positive integer number of microseconds")
    return max(1, min(-(-value // 1000), MAX_TIMEOUT_MS))  # integer ceil: a float of a 400-digit int overflows


def _check_parameter_ints(parameters: dict[str, JsonValue]) -> None:
    """BadBodyError (400, v2's status for every invalid request) for an integer the wire cannot carry."""
    try:
        for name, value in parameters.items():
            check_wire_ints(value, f"parameters.{name[:100]}")
    except InvalidInputError as exc:
        raise BadBodyError(exc.message) from exc


def _check_outputs(spec: ModelSpec, parsed: V2InferRequest) -> None:
    declared = spec.outputs[0].name
    unknown = [o.name for o in parsed.outputs or () if o.name != declared]
    if unknown:
        raise BadBodyError(f"model {spec.name!r} has no output {unknown}; it has {declared!r}")


def _render(model: str, parsed: V2InferRequest, spec: ModelSpec, outputs: list[object]) -> Response:
    """The output tensor as JSON, or binary when asked (per output `binary_data`, else the
    request's `binary_data_output`)."""
    declared = spec.outputs[0]
    binary = parsed.parameters.get("binary_data_output") is True
    if parsed.outputs and "binary_data" in parsed.outputs[0].parameters:  # an output's own choice wins
        binary = parsed.outputs[0].parameters["binary_data"] is True
    tensor: dict[str, Any] = {"name": declared.name, "datatype": declared.datatype}
    head: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION, "outputs": [tensor]}
    if parsed.id is not None:
        head["id"] = parsed.id
    data: list[str] | np.ndarray
    if declared.datatype == "BYTES":
        data, raw = _bytes_elements(outputs)
        tensor["shape"] = [len(data)]
    else:
        array = np.asarray(outputs, dtype=DTYPES[declared.datatype])
        # The array itself: render.json_bytes writes it from its buffer, no Python number per element
        # (a 32 x 384 FP32 reply: 0.24 against 4.4 ms with tolist + json.dumps, 131 against 237 KB).
        data, raw = array.ravel(), array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        tensor["shape"] = list(array.shape)
    if not binary:
        tensor["data"] = data
        return FastJSONResponse(head)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps(head).encode()
    return Response(header + raw, media_type=OCTET, headers={"Inference-Header-Content-Length": str(len(header))})


def _bytes_elements(outputs: list[object]) -> tuple[list[str], bytes]:
    """A BYTES output: one element per item, a string as it is and anything else (a JSON object
    such as a classifier's labels) as its JSON text; (the elements, their binary form: each a
    4-byte little-endian length, then its UTF-8)."""
    texts = [v if isinstance(v, str) else json.dumps(jsonable(v)) for v in outputs]
    encoded = [t.encode() for t in texts]
    return texts, b"".join(struct.pack("<I", len(e)) + e for e in encoded)


def error_body(message: str) -> dict[str, str]:
    """The v2 error shape."""
    return {"error": message}
