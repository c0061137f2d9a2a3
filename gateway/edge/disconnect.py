"""A client that disconnects while its request waits: the HTTP server does not cancel a handler
whose client left, so the connection is watched beside the wait (its ASGI receive() says
http.disconnect once the body has been read). The caller then tells the worker through the
request's cancel key (Dispatcher.close_stream), so nothing more is computed for it.

Most requests are answered in tens of milliseconds, and a watcher is a task of its own, the
largest fixed cost of a request on the gateway after the HTTP stack: so the watch starts only
once a request has waited WATCH_AFTER_S, and a disconnect cancels the waiting handler itself.
A client that leaves sooner is noticed then, when its batch has most likely run. The waits due
for a watch are coarse timers (gateway/edge/coarsetimers.py), checked every half WATCH_AFTER_S, so a
watch starts 1 to 1.5 WATCH_AFTER_S into the wait, with no timer of its own per request."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from vramguard.gateway.edge.checks import ClientGoneError
from vramguard.gateway.edge.coarsetimers import CoarseTimers

T = TypeVar("T")

WATCH_AFTER_S = 0.25


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result (or its error), unless the client disconnects first: then `work` is
    cancelled and ClientGoneError (499, counted client_disconnected) is raised. Must be awaited
    by the task that serves the request (it is the one cancelled on a disconnect)."""
    handler = asyncio.current_task()
    assert handler is not None, "unless_disconnected runs in the request's task"
    watch = _Watch(request, handler)
    starts = _watch_starts(handler.get_loop())
    starts.call_later(watch, WATCH_AFTER_S, watch.start)
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours only when the watcher cancelled, and nothing else has asked the handler to stop.
        if watch.gone and handler.uncancel() == 0:
            raise ClientGoneError("the client disconnected before its answer") from None
        raise
    finally:
        starts.cancel(watch)
        watch.stop()
    if watch.gone:  # the work ended as the cancel came and swallowed it (Python 3.11's wait_for can)
        handler.uncancel()
        raise ClientGoneError("the client disconnected before its answer")
    return result


# The watches due to start, per event loop: checked every half WATCH_AFTER_S.
_starts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CoarseTimers] = weakref.WeakKeyDictionary()


def _watch_starts(loop: asyncio.AbstractEventLoop) -> CoarseTimers:
    starts = _starts.get(loop)
    if starts is None:
        starts = _starts[loop] = CoarseTimers(loop, WATCH_AFTER_S / 2)
    return starts


class _Watch:
    """Reads the request's ASGI receive() in a task of its own until http.disconnect, then
    cancels `handler`, once: `gone` says it did."""

    def __init__(self, request: Request, handler: asyncio.Task[object]) -> None:
        self._request = request
        self._handler = handler
        self._task: asyncio.Task[None] | None = None
        self.gone = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="disconnect-watch")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._handler.cancel()
