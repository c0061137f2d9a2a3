"""A trivial endpoint (a bare ASGI app under uvicorn, no model, no framework) that answers
every request with a tiny JSON body at once: the load client's own ceiling is measured
against it, so that nobody mistakes the client's limit for a server's. Environment: BENCH_PORT."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

BODY = b'{"outputs": [[0.0]]}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
              send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Drain the request body, then answer 200 with BODY (any path, any method)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning", access_log=False)
