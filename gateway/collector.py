"""The gateway process' garbage-collector settings, applied once its startup is done.

CPython's cyclic collector runs a pass of its youngest generation whenever the tracked containers
(dicts, lists, coroutines, futures) allocated since the last pass outnumber those freed by 700,
and a full pass, over every tracked object, after enough of those (the `gc` module's docs,
"thresholds"). A gateway at concurrency 64 holds a few thousand containers in its requests in
flight, so passes came every ~20 requests, found those alive, promoted them, and let them die in
the oldest generation, which then had a full pass every ~2,300 requests, each traversing
everything the imports and the app had made (FastAPI, pydantic, redis-py, OpenTelemetry): 32-44
ms apiece. Measured with gc.callbacks at concurrency 64 with instant workers: 10% of the
gateway's CPU (0.66 of 6.6 s), the full passes 0.41 s of it.

The serving path frees what it makes by reference counting: over 7,000 malformed requests (invalid
JSON, bad schemas, unknown models, wrong media types, KServe and OpenAI errors) and 1,000 clients
that left while their requests waited, CPython's default passes together found 188 unreachable
objects, 75 of them at startup; with the settings below, the one pass that came found 39. So:

- gc.collect(), then gc.freeze() (Python 3.7+): what is alive when startup ends moves to the
  permanent generation, which no pass traverses again; startup's own garbage is collected first,
  since frozen it would never be.
- the youngest generation's threshold 700 -> YOUNG_THRESHOLD: under load a pass comes only once
  that many containers have outlived their requests. The older generations keep CPython's
  thresholds.
- a pass of the two younger generations every SWEEP_INTERVAL_S, whatever the traffic: the new
  threshold counts containers, not bytes, and a rare garbage cycle holding a request body (up to
  max_body_bytes, in a few containers) must not wait for 20,000 more to be collected. Such a pass
  took 0.47 ms over 20,000 young containers beside the frozen app.

The workers keep CPython's defaults: they allocate per batch, not per request, and their passes
took 0.4% of an instant worker's CPU.
"""

from __future__ import annotations

import asyncio
import gc
import logging

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000
SWEEP_INTERVAL_S = 10.0


def tune_for_serving(sweep_interval_s: float = SWEEP_INTERVAL_S) -> None:
    """Collect, freeze the heap, raise the youngest generation's threshold, log both, and start a
    pass of the two younger generations every `sweep_interval_s` on the running event loop.

    Call once, from the running loop of the gateway process (`python -m vramguard.gateway` passes
    it to DrainingServer, which calls it once the app's lifespan has started). Not from the app
    itself: a test process that builds many apps would freeze each one's objects for good."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    loop = asyncio.get_running_loop()
    loop.call_later(sweep_interval_s, _sweep, loop, sweep_interval_s)
    log.info("garbage collector tuned for serving", extra={
        "frozen_objects": gc.get_freeze_count(), "gc_thresholds": list(gc.get_threshold()),
        "sweep_interval_s": sweep_interval_s})


def _sweep(loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
    gc.collect(1)
    loop.call_later(interval_s, _sweep, loop, interval_s)
