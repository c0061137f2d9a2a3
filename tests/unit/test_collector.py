"""The gateway's garbage-collector settings (gateway/collector.py), each in a fresh interpreter:
freezing is for a whole process, and would keep this test process' own objects from collection."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT
from vramguard.gateway.collector import YOUNG_THRESHOLD

# Tunes on a running loop, then makes garbage cycles that only the collector can free: more than a
# young generation holds, then a few that only the sweep finds; reports what it saw.
TUNE_THEN_LEAK_CYCLES = """
import asyncio, gc, json, weakref
from vramguard.gateway.collector import tune_for_serving

class Node:
    pass

def cycles(n):
    refs = []
    for _ in range(n):
        node = Node()
        node.self = node
        refs.append(weakref.ref(node))
    return refs

def alive(refs):
    return sum(ref() is not None for ref in refs)

async def main():
    before = gc.get_threshold()
    startup_garbage = cycles(10)  # unreachable when tuning: collected then, not frozen
    tune_for_serving(sweep_interval_s=0.2)
    many = cycles(3 * gc.get_threshold()[0])
    many_alive = alive(many)
    few = cycles(10)
    few_alive_before_sweep = alive(few)
    await asyncio.sleep(0.5)
    return {"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count(),
            "startup_garbage_alive": alive(startup_garbage), "many": len(many), "many_alive": many_alive,
            "few_alive_before_sweep": few_alive_before_sweep, "few_alive_after_sweep": alive(few)}

print(json.dumps(asyncio.run(main())))
"""


def run_tuned() -> dict[str, object]:
    run = subprocess.run([sys.executable, "-c", TUNE_THEN_LEAK_CYCLES], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def test_tuning_freezes_the_heap_raises_the_young_threshold_and_still_collects_cycles() -> None:
    seen = run_tuned()
    assert seen["after"] == [YOUNG_THRESHOLD, *seen["before"][1:]]  # type: ignore[index]
    assert seen["frozen"] > 1000  # type: ignore[operator]  # the interpreter's and the imports' objects
    assert seen["startup_garbage_alive"] == 0  # collected before the freeze, not frozen with the rest
    # Passes still run under load: of three thresholds' worth of cycles, at most the last one's wait.
    assert seen["many_alive"] <= YOUNG_THRESHOLD, seen


def test_the_sweep_collects_a_few_cycles_the_young_threshold_would_leave_for_long() -> None:
    seen = run_tuned()
    assert seen["few_alive_before_sweep"] == 10
    assert seen["few_alive_after_sweep"] == 0
