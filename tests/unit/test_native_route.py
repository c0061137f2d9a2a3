"""gateway/protocols/native.py: which requests take the native route's lean path, and what that path does
when the handler fails in a way no route expects (a 500 in the native error shape, and the
request's body hold given back). The expected errors (415, 413, 422, 429, 503, 504) go through
the same handlers and are asserted over real HTTP in tests/integration/test_http_edge.py and
the other gateway tests."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from vramguard.gateway.app import create_app
from vramguard.gateway.edge.bodybudget import STATE_KEY
from vramguard.gateway.protocols import native
from vramguard.gateway.protocols.native import native_model
from vramguard.shared.errors import InvalidInputError, VramguardError
from vramguard.shared.settings import Settings


def scope(path: str, method: str = "POST", **extra: object) -> dict[str, object]:
    return {"type": "http", "method": method, "path": path, **extra}


@pytest.mark.parametrize(("path", "model"), [
    ("/v1/models/minilm/infer", "minilm"),
    ("/v1/models/my-model.v2/infer", "my-model.v2"),
])
def test_post_to_a_models_infer_path_takes_the_lean_path(path: str, model: str) -> None:
    assert native_model(scope(path)) == model


@pytest.mark.parametrize("request_scope", [
    scope("/v1/models/minilm/infer", method="GET"),  # the stack's 405
    scope("/v1/models/minilm/infer/"),  # the stack's 404: no redirects
    scope("/v1/models//infer"),  # no model named
    scope("/v1/models/a/b/infer"),  # two segments (or a decoded %2F): no route's {model}
    scope("/v1/models/minilm"),
    scope("/v1/models/minilm/infer", root_path="/behind-a-proxy"),  # the stack strips it
    {"type": "lifespan"},
], ids=["get", "trailing-slash", "empty-model", "two-segments", "model-info", "root-path", "lifespan"])
def test_everything_else_goes_through_the_middleware_stack(request_scope: dict[str, object]) -> None:
    assert native_model(request_scope) is None


async def test_an_unexpected_error_is_a_logged_500_in_the_native_shape_and_frees_its_body_hold(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(Settings(served_models=["synthetic"], model="synthetic"))

    async def broken_endpoint(request: Request) -> Response:
        request.scope["state"][STATE_KEY].take(1000)  # as read_body takes the body's bytes
        request.scope["state"]["request_id"] = "f" * 32
        raise RuntimeError("a bug")

    monkeypatch.setattr(native, "infer_endpoint", broken_endpoint)
    # No lifespan: nothing of the handler's Redis side is needed to reach the error path.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        with caplog.at_level(logging.ERROR, logger="vramguard.gateway.app"):
            response = await client.post("/v1/models/synthetic/infer", json={"inputs": ["x"]})

    assert response.status_code == 500
    assert response.json() == {"error": {"code": "internal", "message": "internal error", "request_id": "f" * 32}}
    assert response.headers["x-should-retry"] == "false"
    assert [r.getMessage() for r in caplog.records] == ["unhandled error"]
    assert app.body_budget.held_bytes == 0


async def test_an_error_handler_that_fails_is_answered_by_the_logged_500(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(Settings(served_models=["synthetic"], model="synthetic"))

    async def refused(request: Request) -> Response:
        raise InvalidInputError("bad input")

    async def broken_handler(request: Request, exc: Exception) -> Response:
        raise RuntimeError("the handler's own bug")

    monkeypatch.setattr(native, "infer_endpoint", refused)
    monkeypatch.setitem(app.exception_handlers, VramguardError, broken_handler)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        with caplog.at_level(logging.ERROR, logger="vramguard.gateway.app"):
            response = await client.post("/v1/models/synthetic/infer", json={"inputs": ["x"]})

    assert response.status_code == 500 and response.json()["error"]["code"] == "internal"
    assert response.headers["x-should-retry"] == "false"
    assert [r.getMessage() for r in caplog.records] == ["unhandled error"]
