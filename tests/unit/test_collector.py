"""The gateway's garbage-collector settings (gateway/collector.py), each in a fresh interpreter:
freezing is for a whole process, and would keep this test process' own objects from collection."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT
from vramguard.gateway.collector import YOUNG_THRESHOLD

# Settles, then makes reference cycles that only the collector can free, more than one young
# generation holds, and reports what it saw.
SETTLE_THEN_LEAK_CYCLES = """
import gc, json, weakref
from vramguard.gateway.collector import settle_after_startup

class Node:
    pass

startup = Node()
startup_ref = weakref.ref(startup)
settle_after_startup()
del startup  # frozen: its reference count still frees it, a cycle of frozen objects would stay
cycles = []
for _ in range(3 * gc.get_threshold()[0]):
    node = Node()
    node.self = node
    cycles.append(weakref.ref(node))
    del node
print(json.dumps({"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "cycles_alive": sum(ref() is not None for ref in cycles), "cycles": len(cycles),
                  "startup_alive": startup_ref() is not None}))
"""


def test_settling_freezes_the_heap_raises_the_young_threshold_and_still_collects_cycles() -> None:
    run = subprocess.run([sys.executable, "-c", SETTLE_THEN_LEAK_CYCLES], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    seen = json.loads(run.stdout)
    assert seen["thresholds"] == [YOUNG_THRESHOLD, 10, 10]
    assert seen["frozen"] > 1000  # the interpreter's and the imports' objects
    assert not seen["startup_alive"]
    # Passes still run: of three thresholds' worth of garbage cycles, at most the last one's wait.
    assert seen["cycles_alive"] <= YOUNG_THRESHOLD, seen
