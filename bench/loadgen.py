"""The closed-loop load generator: `concurrency` clients, each sending its next request as soon
as the previous one is answered, for a warm-up and then a fixed measured duration.

A request is sampled (latency, outcome) when it *starts* inside the measured window; clients
stop starting new requests when the window closes and the ones in flight are awaited, so every
sampled request has a response (or a transport error) and a full latency. Throughput counts
the responses that *arrive* inside the window, so neither the warm-up nor the drain skews it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

REQUEST_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0


@dataclass
class Sample:
    """One measured request: when it started (s since the window opened), latency, outcome."""

    start_s: float
    latency_ms: float
    outcome: str  # the HTTP status as text ("200", "429"...) or the transport error's class name


@dataclass
class PointRun:
    """What one load point produced: the samples and the measured window's wall span."""

    concurrency: int
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    warmup_requests: int = 0
    # Outcomes of the requests started before the window opened: a server that stalls from the start
    # answers nothing inside the window, and these are then the only trace of what happened.
    warmup_outcomes: Counter[str] = field(default_factory=Counter)
    completions_in_window: int = 0  # responses (any outcome) that arrived inside the window
    ok_in_window: int = 0  # 200s among them: the throughput numerator


class _Clock:
    def __init__(self, warmup_s: float, duration_s: float) -> None:
        self.t0 = time.perf_counter()
        self.window_open = self.t0 + warmup_s
        self.window_close = self.window_open + duration_s

    def now(self) -> float:
        return time.perf_counter()


async def _client_loop(
    client: aiohttp.ClientSession, url: str, bodies: Callable[[], dict[str, object]], clock: _Clock, run: PointRun
) -> None:
    while True:
        started = clock.now()
        if started >= clock.window_close:
            return
        try:
            async with client.post(url, json=bodies()) as response:
                await response.read()  # the whole body: a reply counts once it has fully arrived
                outcome = str(response.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = type(exc).__name__
        ended = clock.now()
        latency_ms = (ended - started) * 1000
        if clock.window_open <= ended <= clock.window_close:
            run.completions_in_window += 1
            run.ok_in_window += outcome == "200"
        if started >= clock.window_open:
            run.samples.append(Sample(started - clock.window_open, latency_ms, outcome))
        else:
            run.warmup_requests += 1
            run.warmup_outcomes[outcome] += 1


async def _progress(clock: _Clock, run: PointRun, label: str, total_s: float, enabled: bool) -> None:
    with tqdm(total=round(total_s, 1), desc=label, unit="s", leave=False, disable=not enabled,
              bar_format="{desc} {bar} {n:.0f}/{total:.0f}s{postfix}") as bar:
        while True:
            elapsed = min(clock.now() - clock.t0, total_s)
            bar.n = round(elapsed, 1)
            bar.set_postfix_str(f"{len(run.samples)} req")
            if elapsed >= total_s:
                return
            await asyncio.sleep(0.5)


def body_cycle(texts: Sequence[str], make_body: Callable[[str], dict[str, object]]) -> Callable[[], dict[str, object]]:
    """A function returning the next request body, walking `texts` in order and wrapping around
    (the same sequence for every run of the same corpus)."""
    it = itertools.cycle(texts)
    return lambda: make_body(next(it))


async def run_point(
    url: str,
    bodies: Callable[[], dict[str, object]],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    label: str = "",
    progress: bool = True,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> PointRun:
    """Drive `url` with `concurrency` closed-loop clients: `warmup_s` unmeasured, then `duration_s`
    measured. Each user has its own aiohttp session with one keep-alive connection. A request
    not answered within `request_timeout_s` ends as a `TimeoutError` outcome (a stalled server
    makes the point last that long past its window).

    Returns the PointRun; transport errors are recorded as outcomes, never raised.
    """
    # The client shares the machine's cores with the server it measures, so its own CPU per request
    # is taken from the server: aiohttp, because httpx cost 5-7x as much on this 2-core machine
    # (against the trivial endpoint, c=64: about 700 µs of client CPU per request, 1400 req/s;
    # aiohttp 95-105 µs, 9700-10500 req/s). One session (one connection) per closed-loop user, so
    # that no shared pool decides which user goes next.
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, connect=min(CONNECT_TIMEOUT_S, request_timeout_s))
    run = PointRun(concurrency=concurrency, duration_s=duration_s)
    clients = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout)
               for _ in range(concurrency)]
    try:
        clock = _Clock(warmup_s, duration_s)
        ticker = asyncio.create_task(_progress(clock, run, label, warmup_s + duration_s, progress))
        await asyncio.gather(*(_client_loop(client, url, bodies, clock, run) for client in clients))
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    return run
