"""gateway/edge/bodycost.py's JsonCounter with its real helper process: a large body is counted there,
and closing it at shutdown leaves no thread of its pool behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from vramguard.gateway.edge.bodycost import INLINE_BYTES, JsonCounter
from vramguard.shared.errors import PayloadTooLargeError, UnavailableError


def pool_manager_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if type(t).__name__ == "_ExecutorManagerThread"}


async def test_aclose_returns_once_the_pools_manager_thread_has_ended() -> None:
    """A manager thread still running at interpreter exit races concurrent.futures' exit hook
    for its wake-up pipe (an occasional "Bad file descriptor" at the gateway's exit)."""
    before = pool_manager_threads()
    counter = JsonCounter(max_values=100)
    counter.start()
    body = b"[" + b"1," * (INLINE_BYTES // 2) + b"1]"  # over INLINE_BYTES: counted in the helper
    with pytest.raises(PayloadTooLargeError, match="more than the 100"):
        await counter.check(body)
    assert pool_manager_threads() - before  # the pool is up, with its manager thread
    await counter.aclose()
    assert not pool_manager_threads() - before


async def test_aclose_abandons_a_count_instead_of_waiting_for_it() -> None:
    """Shutdown must not wait seconds for a count nobody will read: the helper is killed, and the
    request whose body was queued for it or being counted gets an error, never the count's verdict."""
    counter = JsonCounter(max_values=100)
    counter.start()
    huge = b"[" + b"[]," * (8 * 2**20 // 3) + b"[]]"  # 8 MiB, 2.8 million values: seconds to count
    counting = asyncio.create_task(counter.check(huge))
    await asyncio.sleep(0.1)  # the body is handed to the pool
    await counter.aclose()
    with pytest.raises((UnavailableError, asyncio.CancelledError)):
        await counting
