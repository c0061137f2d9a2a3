"""The pieces of the gateways' shared metrics (prometheus_client's multiprocess mode) that need no
running gateway: the setting, its guard, the sweep of dead processes' live gauges, and up.py's
fresh directory. The sums themselves are proved with real processes in
tests/integration/test_gateway_scale_out.py."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port
from vramguard.cli.main import build_parser
from vramguard.cli.placement import ModelPlacement, plan
from vramguard.cli.up import METRICS_DIR, build_env, fresh_metrics_dir
from vramguard.gateway.observe.metrics import forget_dead_processes, multiprocess_dir
from vramguard.shared.settings import Settings


def test_the_setting_is_prometheus_clients_own_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert Settings.from_env().prometheus_multiproc_dir == str(tmp_path)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    assert Settings.from_env().prometheus_multiproc_dir is None


def test_unset_means_one_process_and_its_own_registry() -> None:
    assert multiprocess_dir(Settings()) is None


def test_a_directory_the_library_was_not_started_with_is_refused(tmp_path: Path) -> None:
    # This test process imported prometheus_client without PROMETHEUS_MULTIPROC_DIR: single-process mode.
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        multiprocess_dir(Settings(prometheus_multiproc_dir=str(tmp_path)))


def exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_exited_processes_lose_their_live_gauges(tmp_path: Path) -> None:
    dead, alive = exited_pid(), os.getpid()
    for name in (f"gauge_livesum_{dead}.db", f"counter_{dead}.db", f"histogram_{dead}.db",
                 f"gauge_livesum_{alive}.db", f"counter_{alive}.db"):
        (tmp_path / name).write_bytes(b"")
    assert forget_dead_processes(tmp_path) == [dead]
    # The dead one's counts stay in the sums; the live process keeps everything.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"counter_{dead}.db", f"histogram_{dead}.db", f"gauge_livesum_{alive}.db", f"counter_{alive}.db"])


def test_up_empties_the_stacks_metrics_directory(tmp_path: Path) -> None:
    stale = tmp_path / METRICS_DIR / "counter_123.db"
    stale.parent.mkdir()
    stale.write_bytes(b"a previous run's counts")
    assert fresh_metrics_dir(tmp_path) == stale.parent
    assert stale.parent.is_dir() and not list(stale.parent.iterdir())
    assert fresh_metrics_dir(tmp_path / "new") == tmp_path / "new" / METRICS_DIR  # created when missing


def test_only_the_gateway_program_gets_the_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VRAMGUARD_REDIS_URL", "redis://127.0.0.1:1/0")  # an existing Redis: none started
    monkeypatch.setenv("VRAMGUARD_PORT", str(free_port()))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # the caller's own: workers must not inherit it
    assert "PROMETHEUS_MULTIPROC_DIR" not in build_env(build_parser().parse_args(["up", "--gateways", "2"]),
                                                       plan([ModelPlacement(name="synthetic")], [], 0.8))
    conf = configparser.RawConfigParser(interpolation=None)
    conf.read(ROOT / "deploy" / "supervisord.conf")
    assert conf["program:gateway"]["environment"] == f'PROMETHEUS_MULTIPROC_DIR="%(ENV_VG_RUN_DIR)s/{METRICS_DIR}"'
    assert "PROMETHEUS_MULTIPROC_DIR" not in conf["vramguard:worker"].get("environment", "")
