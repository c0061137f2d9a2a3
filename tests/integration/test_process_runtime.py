"""What the service processes set up for themselves once started, read in the logs of conftest.py's
edge_stack, a real `python -m vramguard.gateway` and two `python -m vramguard.worker`: the
gateway's garbage-collector settings (gateway/collector.py), the workers' event loop
(shared/eventloop.py)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from tests.helpers import Stack
from vramguard.gateway.collector import SWEEP_INTERVAL_S, YOUNG_THRESHOLD


def events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_the_gateway_process_freezes_its_startup_heap_and_raises_the_young_threshold(edge_stack: Stack) -> None:
    gateway = events(edge_stack.log_dir / "gateway.log")
    (tuned,) = [e for e in gateway if e["message"] == "garbage collector tuned for serving"]
    # FastAPI, pydantic, redis-py and the app: tens of thousands of objects, none traversed again.
    assert tuned["frozen_objects"] > 50_000  # type: ignore[operator]
    # This interpreter's own thresholds are CPython's defaults, as the gateway's were before.
    assert tuned["gc_thresholds"] == [YOUNG_THRESHOLD, *gc.get_threshold()[1:]]
    assert tuned["sweep_interval_s"] == SWEEP_INTERVAL_S
    started = next(i for i, e in enumerate(gateway) if e["message"] == "gateway started")
    assert gateway.index(tuned) > started  # after the lifespan: its connections are frozen too


def test_workers_run_on_uvloop_by_default(edge_stack: Stack) -> None:
    for log in ("worker-0.log", "worker-1.log"):
        (ready,) = [e for e in events(edge_stack.log_dir / log) if e["message"] == "worker ready"]
        assert ready["settings"]["event_loop"] == "auto"  # type: ignore[index]
        assert ready["event_loop_module"] == "uvloop", log
