"""gateway/edge/disconnect.py with a real Starlette Request whose client has gone: the handler's work
is cancelled and the request ends as ClientGoneError, also when the work swallows the cancel (as
Python 3.11's asyncio.wait_for can when its future completes at that moment), and the handler
task is left with no cancel request counted against it."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from vramguard.gateway.edge.checks import ClientGoneError
from vramguard.gateway.edge.disconnect import WATCH_AFTER_S, unless_disconnected


def gone_request() -> Request:
    async def receive() -> dict[str, object]:
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


async def test_work_answered_before_the_watch_starts_is_returned() -> None:
    assert await unless_disconnected(gone_request(), asyncio.sleep(0, result="answer")) == "answer"


async def test_a_disconnect_cancels_the_work_and_ends_as_client_gone() -> None:
    with pytest.raises(ClientGoneError):
        await unless_disconnected(gone_request(), asyncio.sleep(30))
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_work_that_swallows_the_cancel_still_ends_as_client_gone() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "answer"
        return "late"

    with pytest.raises(ClientGoneError):
        await unless_disconnected(gone_request(), stubborn())
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_each_waiting_request_is_watched_from_its_own_start() -> None:
    """The watches share one timer per loop: a request that ends early is never watched, one added
    later is watched once it has waited WATCH_AFTER_S (at most half of it later), not before."""
    loop = asyncio.get_running_loop()
    early = await unless_disconnected(gone_request(), asyncio.sleep(0.05, result="early"))
    await asyncio.sleep(WATCH_AFTER_S / 2)
    started = loop.time()
    with pytest.raises(ClientGoneError):
        await unless_disconnected(gone_request(), asyncio.sleep(30))
    waited = loop.time() - started
    assert early == "early" and WATCH_AFTER_S <= waited < 1.5 * WATCH_AFTER_S + 0.5, waited
