"""`python -m bench` on a machine without matplotlib (the bench extra): --help and the commands
that draw nothing work; a command that needs it says so and how to install it. matplotlib is
installed here, so each run is a Python process that blocks its import before bench starts."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

# The benchmark's own tools, not the service: the slow tier (make test-all).
pytestmark = pytest.mark.slow

# `python -m bench ARGS` with `import matplotlib` failing as it does where the package is missing.
WITHOUT_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; "
                      "from bench.__main__ import main; sys.exit(main(sys.argv[1:]))")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


class Answer(http.server.BaseHTTPRequestHandler):
    """200 with an empty JSON result to every POST: an endpoint for `bench load`."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"outputs": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/infer"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("args", [["--help"], ["report", "--help"], ["all", "--help"], ["load", "--help"]])
def test_help_works_without_matplotlib(args: list[str]) -> None:
    done = bench(*args)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m bench"), done.stderr


def test_a_load_sweep_runs_without_matplotlib(endpoint: str) -> None:
    """1. `python -m bench load` for 0.3 s at concurrency 1 against a local endpoint.
    Result: exit 0 and one JSON line for the point, every request answered."""
    done = bench("load", endpoint, "--duration-s", "0.3", "--warmup-s", "0", "--concurrency", "1", "--no-progress")
    assert done.returncode == 0, done.stderr
    point = json.loads(done.stdout.strip().splitlines()[-1])
    assert point["suite"] == "load" and point["requests"] > 0 and point["errors"] == {}, point


@pytest.mark.parametrize("command", ["report", "all", "image"])
def test_a_command_that_needs_matplotlib_says_how_to_install_it_before_running(command: str, tmp_path: Path) -> None:
    """Result: exit 2 at once (`all` before its first suite), one line naming matplotlib and the
    pip commands, no traceback, nothing written to the results folder."""
    done = bench(command, "--out", str(tmp_path))
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = done.stderr.strip()
    assert line.startswith(f"bench {command}: needs matplotlib (") and len(line.splitlines()) == 1, line
    assert 'pip install matplotlib, or the bench extra: pip install -e ".[bench]"' in line, line
    assert done.stdout == "" and "Traceback" not in line and not any(tmp_path.iterdir())
