"""The alternating suites that compare two servers (bench/suites.py `one_at_a_time`: peer,
latency) measure each alone: the server not measured is stopped, so its idle loops take no CPU
from the one measured. Two real trivial endpoints stand in for the servers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench import suites
from bench.services import ProcessService, trivial
from bench.suites import BenchConfig, one_at_a_time

# The benchmark's own tools, not the service: the slow tier (make test-all).
pytestmark = pytest.mark.slow


def test_each_server_is_measured_alone_in_alternating_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1. Two trivial endpoints, A and B; two rounds at concurrency 2, 0.3 s points.
    2. At each point, which of the two processes are running is noted.
    Result: the points go A B A B; at each, the one measured runs and the other is not running;
    every record carries its round and an idle CPU share; both are stopped at the end."""
    a, b = trivial(tmp_path / "a"), trivial(tmp_path / "b")
    a.name, b.name = "a", "b"
    running: list[tuple[str, bool, bool]] = []
    measure = suites.measure

    def noting(service: ProcessService, *args: object, **kwargs: object) -> dict[str, object]:
        running.append((service.name, *(p.proc is not None and p.proc.poll() is None for p in (a, b))))
        return measure(service, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(suites, "measure", noting)
    monkeypatch.setattr(suites, "IDLE_S", 0.2)
    cfg = replace(BenchConfig(), duration_s=0.3, warmup_s=0.1, pairs=2, out_dir=tmp_path, progress=False)
    records = list(one_at_a_time(cfg, "test", [("A", a), ("B", b)], 2))
    assert [(r["config"], r["pair"]) for r in records] == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert running == [("a", True, False), ("b", False, True)] * 2
    assert all(0 <= float(r["idle_cpu_share"]) < 1 and r["ok"] == r["requests"] > 0 for r in records)  # type: ignore[arg-type]
    assert all(p.proc is not None and p.proc.poll() is not None for p in (a, b))
