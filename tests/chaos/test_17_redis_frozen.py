"""Scenario 16: Redis frozen (SIGSTOP, as a VM pause or a swap storm freezes it) under a steady load.

1. A gateway and a worker on a Redis of their own; a client sends 20 requests a second, each on
   its own (open loop: a slow answer does not slow the sending), deadline 30 s.
2. At 3 s the test SIGSTOPs Redis; at 18 s (15 s later) it SIGCONTs it; the load runs to 24 s.

Result: no request gets a 500 or waits out its deadline (504); every request sent while Redis is
frozen is answered 503 `unavailable` within 2.5 s, or served (those in flight when it froze are
served once it thaws); every request sent from 1 s after SIGCONT is served. The bounds on elapsed
time are times load_slack() (tests/helpers.py).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.conftest import CHAOS_SETTINGS
from tests.chaos.load import open_loop, record_figures
from tests.helpers import RedisServer, Stack, load_slack

RATE_PER_S = 20
FREEZE_AT_S, FROZEN_S, LOAD_S = 3.0, 15.0, 24.0
TIMEOUT_MS = 30_000
ANSWER_BOUND_S = 2.5  # a request sent to a frozen Redis: 503 within this
SERVED_AGAIN_S = 1.0  # after SIGCONT


@pytest.fixture
def frozen_stack(fast_settings: dict[str, object], tmp_path: Path) -> Iterator[tuple[Stack, RedisServer]]:
    server = RedisServer()
    server.start()
    values = {k: v for k, v in fast_settings.items() if k != "redis_url"}
    stack = Stack(server.url, tmp_path, **{**values, **CHAOS_SETTINGS})
    try:
        yield stack, server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        stack.stop()
        server.stop()


async def test_redis_frozen_15_s_gives_503_within_2_5_s_and_service_within_1_s_of_sigcont(
        frozen_stack: tuple[Stack, RedisServer]) -> None:
    stack, server = frozen_stack
    stack.start_gateway()
    stack.start_worker()
    await stack.wait_ready()
    assert server.proc is not None
    started = time.monotonic()

    async def freeze() -> None:
        await asyncio.sleep(FREEZE_AT_S)
        server.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        await asyncio.sleep(FROZEN_S)
        server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]

    answers, _ = await asyncio.gather(open_loop(stack.url, RATE_PER_S, LOAD_S, started, TIMEOUT_MS), freeze())
    slack = load_slack()
    thaw_s = FREEZE_AT_S + FROZEN_S
    frozen = [a for a in answers if FREEZE_AT_S <= a.sent_s < thaw_s]
    refused = [a for a in frozen if a.status == 503]
    after = [a for a in answers if a.sent_s >= thaw_s + SERVED_AGAIN_S * slack]
    first_ok = min((a.sent_s for a in answers if a.sent_s >= thaw_s and a.status == 200), default=None)
    record_figures(f"16 Redis frozen {FROZEN_S:g} s at {RATE_PER_S}/s: {len(answers)} requests, "
                   f"{len(refused)} of {len(frozen)} sent while frozen got 503, slowest 503 "
                   f"{max((a.latency_s for a in refused), default=0):.2f} s, first served "
                   f"{(first_ok - thaw_s) if first_ok is not None else float('nan'):.2f} s after SIGCONT, "
                   f"statuses {sorted({(a.status, a.code) for a in answers}, key=str)}, slack {slack:.1f}")
    statuses = sorted({(a.status, a.code) for a in answers}, key=str)
    assert not [a for a in answers if a.status not in (200, 503)], statuses
    assert all(a.code == "unavailable" for a in refused)
    assert refused and max(a.latency_s for a in refused) < ANSWER_BOUND_S * slack
    assert after and all(a.status == 200 for a in after), [(round(a.sent_s, 2), a.status)
                                                           for a in after if a.status != 200]
