"""gateway/disconnect.py with a real Starlette Request whose client has gone: the handler's work
is cancelled and the request ends as ClientGoneError, also when the work swallows the cancel (as
Python 3.11's asyncio.wait_for can when its future completes at that moment), and the handler
task is left with no cancel request counted against it."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from vramguard.gateway.disconnect import unless_disconnected
from vramguard.gateway.edge import ClientGoneError


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
