"""What the OpenAPI schema (GET /openapi.json) says about bodies the routes read themselves and
about their error responses, so schema-driven clients and fuzzers (schemathesis) see every route
as it behaves. Routes read their bodies by hand (size cap, gzip, media type), so FastAPI cannot
infer the request body: `request_body` declares it; `install_schemas` adds the models it refers to."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
_EXTRA_SCHEMAS: dict[str, dict[str, Any]] = {}


class ErrorDetail(BaseModel):
    code: str
    message: str
    request_id: str | None


class ErrorBody(BaseModel):
    """vramguard's error shape (native routes): {"error": {"code", "message", "request_id"}}."""

    error: ErrorDetail


# The statuses each family of routes may answer besides 200 (the native and v2 routes share them).
NATIVE_ERRORS = (400, 401, 404, 413, 415, 422, 429, 500, 503, 504)
_DESCRIPTIONS = {
    400: "body not parseable", 401: "missing or wrong API key", 404: "unknown model", 413: "body, inputs or an "
    "input too large", 415: "wrong Content-Type or Content-Encoding", 422: "invalid input or parameter",
    429: "queue full (Retry-After)", 500: "model error", 503: "no worker or broker unreachable (Retry-After)",
    504: "deadline exceeded",
}


def request_body(model: type[BaseModel], media_types: Iterable[str] = ("application/json",)) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` as its body itself."""
    schema = model.model_json_schema(ref_template=REF)
    for name, definition in schema.pop("$defs", {}).items():
        _EXTRA_SCHEMAS[name] = definition
    _EXTRA_SCHEMAS[model.__name__] = schema
    content = {media: {"schema": {"$ref": REF.format(model=model.__name__)}} for media in media_types}
    return {"requestBody": {"required": True, "content": content}}


def error_responses(statuses: Iterable[int], body: type[BaseModel] = ErrorBody) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route: each status with its error body model."""
    return {status: {"model": body, "description": _DESCRIPTIONS.get(status, "error")} for status in statuses}


def install_schemas(app: FastAPI, served_models: list[str], invalid_is_400: Callable[[str], bool]) -> None:
    """Make `app.openapi()` include the body models `request_body` registered, name the served
    models as the values of every `{model}` path parameter, and drop the 422 FastAPI documents on
    every route with parameters from the paths for which `invalid_is_400` is true (the v2 and
    OpenAI routes, which answer 400 instead: app.render_error) and from the routes no request to
    can be invalid."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_EXTRA_SCHEMAS)
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    if invalid_is_400(path) or not _can_be_invalid(operation):
                        operation.get("responses", {}).pop("422", None)
                    for parameter in operation.get("parameters", []):
                        if parameter["in"] == "path" and parameter["name"] == "model":
                            parameter["schema"] = {"type": "string", "enum": list(served_models)}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _can_be_invalid(operation: dict[str, Any]) -> bool:
    """Whether FastAPI can refuse a request to `operation` (an OpenAPI operation object) as invalid:
    not when it takes no body and only plain string parameters, which every request satisfies,
    although FastAPI documents a 422 for every operation with parameters."""
    return "requestBody" in operation or any(
        parameter.get("schema", {}).get("type") != "string" for parameter in operation.get("parameters", []))
