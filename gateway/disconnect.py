"""A client that disconnects while its request waits: the HTTP server does not cancel a handler
whose client left, so the connection is watched beside the wait (its ASGI receive() says
http.disconnect once the body has been read). The caller then tells the worker through the
request's cancel key (Dispatcher.close_stream), so nothing more is computed for it.

Most requests are answered in tens of milliseconds, and a watcher is a task of its own, the
largest fixed cost of a request on the gateway after the HTTP stack: so the watch starts only
once a request has waited WATCH_AFTER_S, and a disconnect cancels the waiting handler itself.
A client that leaves sooner is noticed then, when its batch has most likely run. The waits due
for a watch are started by one repeating timer per event loop (`_WatchStarter`, every half
WATCH_AFTER_S, so a watch starts 1 to 1.5 WATCH_AFTER_S into the wait), not a timer per request:
on uvloop a timer's call_later and cancel cost 2.6-4.8 us with the hundreds pending under load."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from vramguard.gateway.edge import ClientGoneError

T = TypeVar("T")

WATCH_AFTER_S = 0.25


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result (or its error), unless the client disconnects first: then `work` is
    cancelled and ClientGoneError (499, counted client_disconnected) is raised. Must be awaited
    by the task that serves the request (it is the one cancelled on a disconnect)."""
    handler = asyncio.current_task()
    assert handler is not None, "unless_disconnected runs in the request's task"
    watch = _Watch(request, handler)
    starter = _starter(handler.get_loop())
    starter.add(watch)
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours only when the watcher cancelled, and nothing else has asked the handler to stop.
        if watch.gone and handler.uncancel() == 0:
            raise ClientGoneError("the client disconnected before its answer") from None
        raise
    finally:
        starter.discard(watch)
        watch.stop()
    if watch.gone:  # the work ended as the cancel came and swallowed it (Python 3.11's wait_for can)
        handler.uncancel()
        raise ClientGoneError("the client disconnected before its answer")
    return result


class _WatchStarter:
    """Starts each added watch once it has been added for WATCH_AFTER_S, unless it is discarded
    first; one per event loop. Every wait is added with the same delay, so the dict's order (the
    order of adding) is the order they fall due."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[_Watch, float] = {}  # watch -> the loop time it starts at
        self._timer: asyncio.TimerHandle | None = None

    def add(self, watch: _Watch) -> None:
        self._due[watch] = self._loop.time() + WATCH_AFTER_S
        if self._timer is None:
            self._timer = self._loop.call_later(WATCH_AFTER_S / 2, self._start_due)

    def discard(self, watch: _Watch) -> None:
        self._due.pop(watch, None)

    def _start_due(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._due:
            watch, due = next(iter(self._due.items()))
            if due > now:
                break
            del self._due[watch]
            watch.start()
        if self._due:
            self._timer = self._loop.call_later(WATCH_AFTER_S / 2, self._start_due)


_starters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _WatchStarter] = weakref.WeakKeyDictionary()


def _starter(loop: asyncio.AbstractEventLoop) -> _WatchStarter:
    starter = _starters.get(loop)
    if starter is None:
        starter = _starters[loop] = _WatchStarter(loop)
    return starter


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
