"""A client that disconnects while its request waits: the HTTP server does not cancel a handler
whose client left, so the connection is watched beside the wait (its ASGI receive() says
http.disconnect once the body has been read). The caller then tells the worker through the
request's cancel key (Dispatcher.close_stream), so nothing more is computed for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from vramguard.gateway.edge import ClientGoneError

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result (or its error), unless the client disconnects first: then `work` is
    cancelled and ClientGoneError (499, counted client_disconnected) is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGoneError("the client disconnected before its answer")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
