"""The event loop a process runs on: `Settings.event_loop` picks it for the gateway (uvicorn's
`loop` option) and for the worker (`run`), so both follow one setting.

uvloop (libuv, Cython) wakes, schedules and writes to sockets in C. On the worker's serving path,
where every batch is a Redis read, a hop to the model thread and back and a Redis write, asyncio's
own loop spent a quarter of an instant worker's samples in its selector and transports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

EventLoopChoice = Literal["auto", "asyncio", "uvloop"]


def loop_factory(choice: EventLoopChoice) -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of the loop `choice` names, as uvicorn resolves its `loop` option: "auto" is
    uvloop when it imports and asyncio's own otherwise; "uvloop" requires it (ImportError if it is
    not installed)."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: EventLoopChoice = "auto") -> T:
    """Run `main` to its end on a new loop of the kind `choice` names (loop_factory) and close the
    loop, as asyncio.run does, except that the loop is not set as the thread's current one
    (asyncio.Runner with a loop_factory does not): code must use get_running_loop()."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
