"""`python -m vramguard.worker.health.alive`: the worker's liveness check for an exec probe (deploy/k8s/).

Workers have no HTTP port, and the probe must not ask Redis: a Redis that stalls, is down or
refuses writes stops every worker's heartbeat in Redis at once, a restart fixes none of that, and
a probe waiting on Redis outlives the kubelet's timeoutSeconds (a timeout counts as a failure).
So the worker's heartbeat task also touches a file of its own on the local disk every
`heartbeat_interval_ms`, whatever Redis answers (`alive_file`, worker/health/heartbeat.py), and the
probe reads only that file's age. Exit 0: younger than heartbeat_ttl_ms. Exit 1: missing or older:
the worker's event loop is hung, the worker never got ready (a startupProbe covers the warmup) or
it exited. The whole check, the interpreter's imports included, is bounded by `--timeout-s`: past
it the probe exits 0 (a node too busy to answer is no verdict on the worker).
Never imports torch or redis: it runs every few seconds beside the worker.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vramguard.shared.settings import Settings

# The bound on the whole check. The probe's timeoutSeconds (deploy/k8s/base/worker.yaml, 8 s) leaves
# room above it for starting the interpreter (up to seconds on a loaded node).
PROBE_TIMEOUT_S = 3.0


def alive_file(key_prefix: str, worker_id: str) -> Path:
    """The file the worker `worker_id` touches every heartbeat interval, in the host's temporary
    folder (tempfile.gettempdir(): TMPDIR, else /tmp; the probe runs in the worker's container, so it
    sees the same one). Characters outside [A-Za-z0-9._-] in the names become `_`."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"vramguard-{key_prefix}-{worker_id}.alive")
    return Path(tempfile.gettempdir()) / name


def touch_alive_file(path: Path) -> None:
    """Set `path`'s modification time to now, creating it if missing. Raises OSError."""
    path.touch()


def check(settings: Settings) -> tuple[bool, str]:
    """(alive, why) for the worker named settings.consumer_name, from its alive file's age (ms, on
    this host's clock, which both the worker and the probe read). Never touches Redis."""
    path = alive_file(settings.key_prefix, settings.consumer_name)
    try:
        age_ms = (time.time() - path.stat().st_mtime) * 1000
    except FileNotFoundError:
        return False, (f"no heartbeat for worker {settings.consumer_name!r} ({path} missing: hung, exited, "
                       f"or still warming up)")
    if age_ms <= settings.heartbeat_ttl_ms:
        return True, f"heartbeat {age_ms:.0f} ms old"
    return False, f"heartbeat {age_ms:.0f} ms old (heartbeat_ttl_ms {settings.heartbeat_ttl_ms}): the worker is hung"


def _give_up(timeout_s: float) -> None:
    """The probe's hard bound, on a timer thread: whatever the main thread is doing (importing on a
    node short of CPU, reading a stalled disk), exit 0 with a line that says so."""
    print(f"the check did not finish within {timeout_s} s (the node is busy); not judging the worker", flush=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vramguard.worker.health.alive",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=PROBE_TIMEOUT_S,
                        help=f"bound on the whole check, seconds (default {PROBE_TIMEOUT_S}); keep it "
                             "a few seconds below the probe's timeoutSeconds")
    args = parser.parse_args(argv)
    bound = threading.Timer(args.timeout_s, _give_up, (args.timeout_s,))
    bound.daemon = True
    bound.start()
    # Imported once the bound runs: pydantic's import alone takes a second on a loaded node.
    from vramguard.shared.settings import Settings, SettingsError

    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"vramguard.worker.health.alive: {exc}", file=sys.stderr)
        return 2
    if settings.worker_name is None:
        print("vramguard.worker.health.alive: VRAMGUARD_WORKER_NAME must be set (the probe runs in another process)",
              file=sys.stderr)
        return 2
    alive, why = check(settings)
    print(why)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
