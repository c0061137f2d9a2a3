"""What the tracing hooks cost one request while tracing is off (no OTLP endpoint): the gateway's
request, admission and reply blocks, the carrier, and the worker's span calls, timed with timeit
against an empty call. `PYTHONPATH=$PWD .venv/bin/python scripts/tracing_off_cost.py`"""

from __future__ import annotations

import sys
import timeit

from vramguard.shared import tracing
from vramguard.worker.spans import record_queued

HEADERS = {"content-type": "application/json"}
CALLS = 200_000


def hooks() -> None:
    with tracing.server_span(HEADERS, "minilm", "id"):
        tracing.carrier()
        with tracing.child_span("vramguard.admission", {"vramguard.queue_bound": 1000}):
            pass
        with tracing.child_span("vramguard.reply") as span:
            if span is not None:
                raise AssertionError("tracing is on")
    record_queued([], 0, "worker")
    tracing.tracer()


def empty() -> None:
    pass


def main() -> int:
    if tracing.tracer() is not None:
        print("tracing is on; unset OTEL_EXPORTER_OTLP_ENDPOINT", file=sys.stderr)
        return 2
    with_hooks = min(timeit.repeat(hooks, number=CALLS, repeat=5)) / CALLS
    bare = min(timeit.repeat(empty, number=CALLS, repeat=5)) / CALLS
    print(f"tracing off: {(with_hooks - bare) * 1e6:.2f} µs per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
