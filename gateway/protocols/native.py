"""The native inference route's lean path: POST /v1/models/{model}/infer is served ahead of the
ASGI middleware stack, every other request goes through it.

The stack FastAPI builds around every request (server-error and exception middleware, its
body-limit and telemetry layers, our HoldBodies, the router, the exit-stack middleware) held about
a quarter of the gateway's py-spy samples on this route (concurrency 64, instant workers): work a
request already routed by its path does not need. Served here, the gateway's CPU per request
measured 0.92x (0.70-1.12 over 3 alternating rounds on a noisy 2-core machine). What the stack does for
this route is done here in place: the request's body hold (gateway/edge/bodybudget.py), the app's own
exception handlers (app.py: the same status, headers and error body for each error), and the
unexpected error's 500, logged once. Everything else (other paths, other methods, a trailing
slash, a path that names no model) goes through the stack and answers as it always did.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from vramguard.gateway.edge.bodybudget import STATE_KEY, BodyBudget, BodyHold
from vramguard.gateway.routes import infer_endpoint

_PREFIX, _SUFFIX = "/v1/models/", "/infer"


def native_model(scope: Scope) -> str | None:
    """The model an HTTP request's scope names when it is POST /v1/models/{model}/infer, the path
    Starlette's `{model}` would match (one non-empty segment, percent-decoded as ASGI gives it),
    else None."""
    if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
        return None
    path: str = scope["path"]
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    model = path[len(_PREFIX):-len(_SUFFIX)]
    return model if model and "/" not in model else None


class AppState(State):
    """`app.state` whose values are also plain instance attributes. Starlette's State keeps them
    in a dict behind `__getattr__`, which Python calls only after the normal lookup has failed and
    raised inside: about 1 us per read, and a request reads the app's settings, dispatcher and
    metrics about ten times. Read the same way, written and deleted the same way."""

    def __setattr__(self, key: Any, value: Any) -> None:
        super().__setattr__(key, value)
        object.__setattr__(self, key, value)

    def __delattr__(self, key: Any) -> None:
        super().__delattr__(key)
        object.__delattr__(self, key)

    __setitem__ = __setattr__
    __delitem__ = __delattr__


class GatewayApp(FastAPI):
    """The gateway's FastAPI app with the native inference route served by `serve_native`.
    `body_budget` is the process' BodyBudget, shared with the HoldBodies middleware that holds the
    bodies of every other route."""

    body_budget: BodyBudget

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = AppState()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = native_model(scope)
        if model is not None:
            await self.serve_native(scope, receive, send, model)
        elif scope["type"] == "http" and scope["path"].endswith("\n"):
            # Starlette's route patterns end in `$`, which also matches before a final newline: a path
            # ending in one (%0A) would be served as the path without it. No route's path ends so.
            request = Request(scope, receive, send)
            await (await self._handle(request, StarletteHTTPException(404)))(scope, receive, send)
        elif scope["type"] == "http" and scope["method"] == "HEAD":
            # HEAD is GET without the content (RFC 9110 9.3.2), on every GET route: routed as a GET
            # in a copy of the scope; uvicorn, holding the request's own scope, sends no body.
            await super().__call__({**scope, "method": "GET"}, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def serve_native(self, scope: Scope, receive: Receive, send: Send, model: str) -> None:
        """Serve one native inference request: routes.infer_endpoint's response, or the app's
        exception handler's for its error; the body hold is released once the response is sent."""
        scope["app"] = self  # what Starlette sets: request.app, and through it app.state
        scope["path_params"] = {"model": model}
        hold = BodyHold(self.body_budget)
        scope.setdefault("state", {})[STATE_KEY] = hold
        request = Request(scope, receive, send)
        try:
            try:
                response = await infer_endpoint(request)
            except Exception as exc:  # noqa: BLE001 - every error is answered, as the stack answers it
                response = await self._handle(request, exc)
            await response(scope, receive, send)
        finally:
            hold.release()

    async def _handle(self, request: Request, exc: Exception) -> Response:
        """The response of the exception handler app.py installed for `exc`'s nearest class (the
        lookup Starlette's ExceptionMiddleware makes). A handler that fails itself is answered as
        the stack's server-error middleware answers it: by `Exception`'s handler (the logged 500)."""
        handler = next(h for h in map(self.exception_handlers.get, type(exc).__mro__) if h is not None)
        try:
            return await self._respond(handler, request, exc)
        except Exception as failure:  # noqa: BLE001 - the last resort's own answer below
            unexpected = self.exception_handlers[Exception]
            if handler is unexpected:
                raise
            return await self._respond(unexpected, request, failure)

    @staticmethod
    async def _respond(handler: object, request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)  # type: ignore[operator]  # app.py's are all coroutines
        assert isinstance(response, Response)
        return response
