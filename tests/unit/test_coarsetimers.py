"""gateway/edge/coarsetimers.py: callbacks run once, not before they are due and at most one
resolution after, unless cancelled or replaced; the one timer stops when nothing is pending."""

from __future__ import annotations

import asyncio

from vramguard.gateway.edge.coarsetimers import CoarseTimers

RESOLUTION_S = 0.05


async def test_a_callback_runs_once_between_its_due_time_and_one_resolution_later() -> None:
    loop = asyncio.get_running_loop()
    timers = CoarseTimers(loop, RESOLUTION_S)
    ran: list[float] = []
    started = loop.time()
    timers.call_later("a", 0.12, lambda: ran.append(loop.time() - started))
    await asyncio.sleep(0.5)
    assert len(ran) == 1 and 0.12 <= ran[0] < 0.12 + RESOLUTION_S + 0.3, ran  # room for a busy machine
    assert "a" not in timers and timers._timer is None  # nothing pending: no timer left running


async def test_a_cancelled_or_replaced_callback_does_not_run() -> None:
    timers = CoarseTimers(asyncio.get_running_loop(), RESOLUTION_S)
    ran: list[str] = []
    timers.call_later("gone", 0.0, lambda: ran.append("gone"))
    timers.call_later("kept", 0.0, lambda: ran.append("first"))
    timers.call_later("kept", 0.0, lambda: ran.append("second"))  # the same key: replaces it
    assert "gone" in timers
    timers.cancel("gone")
    await asyncio.sleep(RESOLUTION_S * 4)
    assert ran == ["second"]


async def test_a_callback_may_cancel_another_due_in_the_same_check() -> None:
    timers = CoarseTimers(asyncio.get_running_loop(), RESOLUTION_S)
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        timers.cancel("second")

    timers.call_later("first", 0.0, first)
    timers.call_later("second", 0.0, lambda: ran.append("second"))
    await asyncio.sleep(RESOLUTION_S * 4)
    assert ran == ["first"]
