"""shared/failover.py: `PrimaryWatch.pause`, a reader's back-off that a failover ends early. Without
sentinels the watch never switches by itself; these tests end a pause through its switch event, as
the watch's own check does when the sentinels name a new primary."""

from __future__ import annotations

import asyncio

import pytest

from vramguard.shared.failover import PrimaryWatch
from vramguard.shared.settings import Settings


async def test_a_pause_lasts_its_delay_without_a_switch() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await PrimaryWatch(Settings()).pause(0.05)
    assert loop.time() - started >= 0.05


async def test_a_switch_ends_a_pause_at_once() -> None:
    watch = PrimaryWatch(Settings())
    paused = asyncio.create_task(watch.pause(30))
    await asyncio.sleep(0)
    watch._switched.set()  # what _check does on a new primary
    await asyncio.wait_for(paused, 1)


@pytest.mark.parametrize("passes", range(3))
async def test_a_cancel_that_comes_with_a_switch_is_not_swallowed(passes: int) -> None:
    """A reader cancelled (at shutdown) in the loop pass where a switch ends its pause, or a pass or
    two after, must stop. On Python 3.11 asyncio.wait_for returned normally when its inner wait had
    finished by the time it handled the cancel (all three failed that way), and the reader's loop
    read on after its cancel. A cancel that the task accepts must end it cancelled."""
    watch = PrimaryWatch(Settings())
    paused = asyncio.create_task(watch.pause(30))
    await asyncio.sleep(0)  # waiting on the switch
    watch._switched.set()
    for _ in range(passes):
        await asyncio.sleep(0)
    if paused.cancel():  # False only when the pause had already returned: nothing to stop
        with pytest.raises(asyncio.CancelledError):
            await paused
    else:
        assert paused.done() and not paused.cancelled()
