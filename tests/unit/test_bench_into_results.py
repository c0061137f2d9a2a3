"""`python -m bench <suite> --into-results`: one suite re-run in place of its records in a whole run's
results.jsonl, the run's header, other suites and closing wall time kept."""

from __future__ import annotations

import json
from pathlib import Path

from bench.__main__ import main, replace_suite


def test_a_suites_records_replace_its_old_ones_before_the_wall_time(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    old = [{"suite": "meta", "note": ""}, {"suite": "generate", "tokens_per_s": 1.0}, {"suite": "fairness", "p99": 2},
           {"suite": "generate", "tokens_per_s": 3.0}, {"suite": "wall", "wall_s": 9.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    replace_suite(path, "generate", [{"suite": "generate", "tokens_per_s": 5.0}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        old[0], old[2], {"suite": "generate", "tokens_per_s": 5.0}, old[4]]


def test_into_results_without_a_whole_run_is_refused_before_measuring(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["generate", "--into-results", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "needs a whole run's" in capsys.readouterr().err and not list(tmp_path.iterdir())
