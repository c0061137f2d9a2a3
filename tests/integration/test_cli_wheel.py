"""`pip install vramguard[worker]` and one command, for real: the wheel is built from this checkout,
installed into a fresh virtualenv outside it, and `vramguard up` runs from yet another folder, with
no PYTHONPATH: every file the stack needs (supervisor config, status page, models) must come from
the wheel.

The virtualenv gets only the wheel (pip --no-deps); the dependencies are the test environment's own,
reached through a .pth line (as `--system-site-packages` would, without reinstalling torch): what is
under test is vramguard's wheel and its command, not pip's resolver.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

READY_S = 240  # two stacks import torch at once on a busy 2-core machine


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    elsewhere: Path  # a folder outside the checkout and the venv: where the user runs `vramguard`

    @property
    def command(self) -> str:
        return str(self.venv / "bin" / "vramguard")


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout's files (tracked or new, not ignored), built in a copy of them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    src = out / "src"
    for name in filter(None, files):
        path = ROOT / name
        if path.exists() or path.is_symlink():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                (src / name).symlink_to(os.readlink(path))
            else:
                shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out / "dist"), str(src)], check=True, timeout=300)
    return next((out / "dist").glob("vramguard-*.whl"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = base / "elsewhere"
    shutil.copytree(ROOT / "examples" / "tiny_classifier" / "tiny_classifier", elsewhere / "tiny_classifier")
    return Installed(wheel, venv, elsewhere)


def clean_env() -> dict[str, str]:
    """The user's environment: no PYTHONPATH into the checkout, no VRAMGUARD_* of the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_") and k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.mark.timeout(300)  # builds the wheel and the virtualenv
def test_the_wheel_carries_what_up_needs_and_nothing_of_the_tests(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    for needed in ("vramguard/cli/supervisord.conf", "vramguard/cli/up.py", "vramguard/gateway/observe/status.html",
                   "vramguard/worker/models/minilm.py", "vramguard/worker/models/efficientnet.py",
                   "vramguard/shared/models.py", "vramguard/gateway/__main__.py", "vramguard/worker/__main__.py"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("tests/", "bench/", "deploy/", "examples/")) or "conftest" in n]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vramguard = vramguard.cli.main:main" in zipfile.ZipFile(installed.wheel).read(entry_points).decode()
    python = str(installed.venv / "bin" / "python")
    where = subprocess.run([python, "-c", "import vramguard; print(vramguard.__file__)"], cwd=installed.elsewhere,
                           env=clean_env(), capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(installed.venv)), where.stdout  # the wheel's copy, not the checkout's


@dataclass
class Launched:
    proc: subprocess.Popen[bytes]
    out: Path
    run_dir: Path
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_ready(self) -> str:
        """The request line `up` prints once ready."""
        deadline = time.monotonic() + READY_S
        while "vramguard is ready at" not in self.text():
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                             for p in sorted(self.run_dir.glob("*.log")))
            assert self.proc.poll() is None and time.monotonic() < deadline, f"{self.text()[-3000:]}\n{logs}"
            time.sleep(0.5)
        assert f"vramguard is ready at {self.url}" in self.text()
        return next(line.strip() for line in self.text().splitlines() if line.strip().startswith("curl"))


def vramguard_up(installed: Installed, name: str, *args: str) -> Launched:
    port, run_dir = free_port(), installed.elsewhere / f"run-{name}"
    out = installed.elsewhere / f"{name}.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen([installed.command, "up", "--port", str(port), "--redis-port", str(free_port()),
                                 "--run-dir", str(run_dir), *args], cwd=installed.elsewhere, env=clean_env(),
                                stdout=sink, stderr=subprocess.STDOUT)
    return Launched(proc, out, run_dir, port)


@pytest.fixture(scope="module")
def stacks(installed: Installed) -> Iterator[tuple[Launched, Launched]]:
    """`vramguard up` (minilm, the default) and `vramguard up --backend` (the example class), started together."""
    minilm = vramguard_up(installed, "minilm")
    tiny = vramguard_up(installed, "tiny", "--backend", "tiny_classifier.serving:TinyClassifier")
    try:
        yield minilm, tiny
    finally:
        for launched in (minilm, tiny):
            if launched.proc.poll() is None:
                launched.proc.send_signal(signal.SIGINT)
        for launched in (minilm, tiny):
            try:
                launched.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                subprocess.run([installed.command, "down", "--run-dir", str(launched.run_dir)], env=clean_env(),
                               timeout=120, check=False)
                launched.proc.kill()
                launched.proc.wait()


def curl_body(line: str) -> tuple[str, str]:
    """(URL, JSON body) of the curl line `up` printed."""
    match = re.fullmatch(r"curl -s -X POST (\S+) -H 'Content-Type: application/json' -d '(.*)'", line)
    assert match, line
    return match.group(1), match.group(2)


@pytest.mark.timeout(420)  # two stacks, minilm among them, start at once on two busy cores
def test_vramguard_up_from_the_wheel_serves_minilm_and_a_users_class(stacks: tuple[Launched, Launched]) -> None:
    """1. `vramguard up` and `vramguard up --backend tiny_classifier.serving:TinyClassifier`, from a
       folder outside the checkout, with the wheel's files only.
    2. Each prints its URL and a request line once ready; the request line is sent as printed.
    3. Ctrl-C (SIGINT) to each launcher.
    Result: minilm answers 384 floats per input, the user's class 3 probabilities; the status page
    (/ and /status, read from the installed package) answers; Ctrl-C stops each whole stack."""
    minilm, tiny = stacks
    for launched, width in ((minilm, 384), (tiny, 3)):
        url, body = curl_body(launched.wait_ready())
        reply = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert [len(vector) for vector in reply.json()["outputs"]] == [width] * len(reply.json()["outputs"])
        for page in ("/", "/status"):
            shown = httpx.get(f"{launched.url}{page}", timeout=30)
            assert shown.status_code == 200 and "<html" in shown.text.lower(), (page, shown.status_code)
    for launched in (minilm, tiny):
        supervisord = int((launched.run_dir / "supervisord.pid").read_text())
        launched.proc.send_signal(signal.SIGINT)
        assert launched.proc.wait(timeout=90) == 0, launched.text()[-2000:]
        with pytest.raises(ProcessLookupError):
            os.kill(supervisord, 0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{launched.url}/health/live", timeout=5)
