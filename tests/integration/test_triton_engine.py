"""A real NVIDIA Triton Inference Server (PyTriton, CPU, in tests/.venv-triton; see the Makefile)
behind vramguard's queue through the KServe v2 backend: served rows, a 422 for a row of the wrong
shape, the server killed (503 naming it; the worker's idle probes meanwhile do not restart it) and
started again (served again)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.ci import require_part
from tests.helpers import ROOT, Stack, free_port, wait_until

TRITON_PYTHON = ROOT / "tests" / ".venv-triton" / "bin" / "python"
SERVER = ROOT / "tests" / "engines" / "triton_doubler.py"

@pytest.fixture(autouse=True)
def _pytriton_venv() -> None:
    """Skipped without the PyTriton venv here, a failure in CI (tests/ci.py)."""
    require_part(TRITON_PYTHON.exists(), "no PyTriton venv: run `make test` (it builds tests/.venv-triton from "
                 "Debian's python3.11; see the Makefile)")


class TritonServer:
    """triton_doubler.py on fixed ports, so that it can stop and start again at the same address."""

    def __init__(self, log_path: Path, scratch: Path) -> None:
        self.ports = [free_port(), free_port(), free_port()]  # HTTP, gRPC, metrics
        self.log_path = log_path
        self.scratch = scratch  # its TMPDIR and workspaces
        self.starts = 0
        self.model_copies: set[Path] = set()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    async def start(self) -> None:
        self.starts += 1
        workspace = self.scratch / f"workspace-{self.starts}"  # PyTriton's; a new one each start
        before = set(Path("/tmp").glob("folder*"))  # tritonserver's python backend copies models to /tmp/folderXXXXXX
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([str(TRITON_PYTHON), str(SERVER), *map(str, self.ports), str(workspace)],
                                         cwd=ROOT, env={**os.environ, "TMPDIR": str(self.scratch)},
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        async def ready() -> bool:
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{self.base_url}/v2/models/doubler/ready")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_until(ready, 60, interval_s=0.5)
        self.model_copies = set(Path("/tmp").glob("folder*")) - before  # removed by a graceful stop, not a crash

    def stop(self, *, crash: bool = False) -> None:
        """Stop the server and wait until its HTTP port refuses connections.

        Graceful (SIGTERM: triton_doubler.py stops the server through PyTriton, which frees its
        shared memory), or, with `crash` or after 30 s, SIGKILL to the process group; the shared
        memory PyTriton names after its pid and tritonserver's model copies are then removed here.
        """
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
        deadline = time.monotonic() + (0 if crash else 30)
        while self.proc.poll() is None or _listening(self.ports[0]):
            if time.monotonic() > deadline:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                for segment in Path("/dev/shm").glob(f"pytrtion{self.proc.pid}-*"):
                    segment.unlink(missing_ok=True)
                for folder in self.model_copies:
                    shutil.rmtree(folder, ignore_errors=True)
            time.sleep(0.1)
        self.proc = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def triton(tmp_path: Path) -> Iterator[TritonServer]:
    # A short folder for PyTriton's workspace and TMPDIR: it binds Unix sockets in them, and a path
    # past 107 bytes fails (AF_UNIX path too long), as one in tmp_path does under pytest-xdist.
    scratch = Path(tempfile.mkdtemp(prefix="vg-triton-"))
    server = TritonServer(tmp_path / "triton.log", scratch)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def models_file(folder: Path, base_url: str) -> Path:
    path = folder / "models.toml"
    path.write_text(
        '[doubler]\nbackend = "vramguard.worker.models.kserve_engine:KServeV2Backend"\n'
        'description = "doubles 4 numbers on a Triton server"\ninput_kind = "json"\n'
        'output = { kind = "tensor", datatype = "float32", shape = [4] }\n'
        f'options = {{ base_url = "{base_url}", model = "doubler", input = "INPUT", output = "OUTPUT", '
        'shape = "4", timeout_s = 3 }\n')
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_triton_behind_the_queue_down_and_back(triton: TritonServer, stack: Stack, tmp_path: Path) -> None:
    # `triton` first: torn down after the stack, so no worker keeps calling it while it stops.
    await triton.start()
    path = models_file(tmp_path, triton.base_url)
    stack.start_gateway(served_models="doubler", models_file=path)
    # Idle probes every second meet the engine down; each gives up after options.timeout_s (3 s) at most.
    worker = stack.start_worker(model="doubler", models_file=path, probe_interval_s=1, heartbeat_ttl_ms=5000)
    await stack.wait_ready()
    rows = [[1, 2, 3, 4], [0.5, -1, 0, 8]]
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        ok = await client.post("/v1/models/doubler/infer", json={"inputs": rows})
        assert ok.status_code == 200, ok.text
        assert ok.json()["outputs"] == [[2 * v for v in row] for row in rows]

        bad = await client.post("/v1/models/doubler/infer", json={"inputs": [[1, 2, 3]]})
        assert bad.status_code == 422 and "shape [4]" in bad.json()["error"]["message"]

        triton.stop(crash=True)
        down = await client.post("/v1/models/doubler/infer", json={"inputs": rows})
        assert down.status_code == 503, down.text
        assert f"engine at {triton.base_url}/v2/models/doubler/infer is unreachable" in down.json()["error"]["message"]
        await asyncio.sleep(3)  # idle probes meet the engine down: they must not restart the worker
        assert worker.poll() is None, stack.logs()

        await triton.start()
        back = await client.post("/v1/models/doubler/infer", json={"inputs": rows})
        assert back.status_code == 200, back.text
    assert worker.poll() is None, stack.logs()
