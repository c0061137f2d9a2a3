"""gateway/admission/deadline.py: the request's one timer, with asyncio.timeout's rules for telling its
own cancellation from one that came from elsewhere."""

from __future__ import annotations

import asyncio

import pytest

from vramguard.gateway.admission.deadline import Deadline


async def test_work_done_in_time_is_returned_and_the_timer_is_gone() -> None:
    with Deadline(5) as deadline:
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not deadline.expired and asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_work_past_the_deadline_raises_timeout_and_leaves_no_cancel_counted() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        with Deadline(0.05):
            await asyncio.sleep(30)
    assert 0.05 <= loop.time() - started < 5
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_deadline_already_past_expires_at_the_next_await() -> None:
    with pytest.raises(TimeoutError):
        with Deadline(-1):
            await asyncio.sleep(30)


async def test_a_cancel_from_elsewhere_stays_a_cancellation() -> None:
    """The client's disconnect (gateway/edge/disconnect.py) cancels the handler: not a 504."""
    async def wait() -> None:
        with Deadline(30):
            await asyncio.sleep(30)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_from_elsewhere_as_the_deadline_fires_stays_a_cancellation() -> None:
    """Both in the same loop pass: the outside request counts, so the task is cancelled, as
    asyncio.timeout leaves it."""
    async def wait() -> None:
        with Deadline(0):
            await asyncio.sleep(30)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0)  # the task enters the block and arms the timer
    task.cancel()  # now, before the timer's callback runs in the next pass
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_entered_outside_a_task_is_an_error() -> None:
    def outside() -> None:
        with Deadline(1):
            pass

    with pytest.raises(RuntimeError):  # a thread without a loop: no task to cancel
        await asyncio.get_running_loop().run_in_executor(None, outside)
