"""What Python writes to stderr by itself (a warning, an uncaught exception in a thread or the main
thread, an exception raised in a __del__) is a JSON line too once configure_logging ran, so that a
service's log stays one JSON object per line."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import threading, warnings
from vramguard.shared.logs import configure_logging

configure_logging("INFO", "gateway")
warnings.warn("a warning")

def fail():
    raise ValueError("in a thread")

thread = threading.Thread(target=fail, name="side")
thread.start()
thread.join()

class Broken:
    def __del__(self):
        raise RuntimeError("in __del__")

Broken()
raise KeyError("at the top")
"""


def test_warnings_and_uncaught_exceptions_are_json_lines() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    events = [json.loads(line) for line in done.stderr.splitlines()]  # a plain-text line fails here
    assert [e["logger"] for e in events] == ["py.warnings", "vramguard.uncaught", "vramguard.unraisable",
                                            "vramguard.uncaught"]
    assert all(e["service"] == "gateway" for e in events)
    assert "a warning" in events[0]["message"]
    assert events[1]["in_thread"] == "side" and "ValueError: in a thread" in events[1]["exc_info"]
    assert "RuntimeError: in __del__" in events[2]["exc_info"]
    assert events[3]["level"] == "CRITICAL" and "KeyError: 'at the top'" in events[3]["exc_info"]
