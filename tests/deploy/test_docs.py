"""The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` passes with every generated
reference filled from this checkout's code, and the strict build really fails on what it claims to
catch (a broken link, a page missing from the nav, a VRAMGUARD_ name that is no setting). The
README is a landing page whose links land, and a bench run rewrites the docs' headline table."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ci import require_part
from tests.helpers import ROOT

BUILD_TIMEOUT_S = 300  # a strict build takes about 6 s of CPU; a loaded 2-core machine stretches it


def mkdocs(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`mkdocs ARGS` from this venv, importing this checkout (the hook generates from it)."""
    require_part(importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"),
                 "mkdocs and mkdocs-material are not installed (pip install -r docs/requirements.txt)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S)


def test_the_site_builds_strict_with_the_references_generated_from_the_code(tmp_path: Path) -> None:
    """1. `mkdocs build --strict` of the checkout into a temporary folder.
    Result: exit 0, and the generated pages hold what the code holds: every setting's variable, every
    subcommand's usage, the gateway's series and the worker's exit codes."""
    from vramguard.shared.models import ModelOverrides
    from vramguard.shared.settings import ENV_PREFIX, Settings

    done = mkdocs("build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for name in Settings.model_fields:
        if name not in ("models", "prometheus_multiproc_dir", "cuda_visible_devices"):
            assert f"{ENV_PREFIX}{name.upper()}" in settings, name
    for knob in ModelOverrides.model_fields:
        assert f"<code>{knob.upper()}</code>" in settings, knob
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("up", "down", "status", "check", "profile"):
        assert f"usage: vramguard {command}" in cli, command
    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    assert "vramguard_requests_total" in metrics and "vramguard_worker_oom_events_total" in metrics
    assert "FORWARD_HUNG" in (site / "guides" / "observe" / "index.html").read_text()
    assert "<!-- generated:" not in settings + cli + metrics


def test_the_strict_build_fails_on_broken_links_an_orphan_page_and_an_unknown_setting(tmp_path: Path) -> None:
    """1. A site with the checkout's mkdocs.yml (theme, hook, validation, strict) but its own pages: an
    index linking to a missing page and to a missing anchor and naming VRAMGUARD_NOT_A_SETTING, and a
    page left out of the nav.
    Result: the build fails, with a warning for each of the four."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](missing.md) and [its part](#no-such-part); set "
                                   "`VRAMGUARD_NOT_A_SETTING=1`.\n")
    (docs / "orphan.md").write_text("# Orphan\n\nIn no nav.\n")
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}], exclude_docs="",
                  hooks=[str(ROOT / "docs" / "hooks" / "reference.py")])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = mkdocs("build", "--strict", "--site-dir", str(tmp_path / "site"), cwd=tmp_path)
    assert done.returncode != 0, done.stderr[-4000:]
    assert re.search(r"WARNING.*index\.md.*missing\.md", done.stderr), done.stderr
    assert re.search(r"WARNING.*index\.md.*#no-such-part", done.stderr), done.stderr
    assert re.search(r'WARNING.*not included in the "nav" configuration:\n  - orphan\.md', done.stderr), done.stderr
    assert re.search(r"WARNING.*VRAMGUARD_NOT_A_SETTING", done.stderr), done.stderr


def test_the_readme_is_a_landing_page_whose_links_land() -> None:
    """At most 250 lines; the commands a newcomer starts with; every relative link a file of the checkout."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for command in ("git clone", "make up", "make test", "curl -N"):
        assert command in readme, command
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), link


def test_the_docs_requirements_pin_what_the_docs_extra_pins() -> None:
    """docs/requirements.txt (what `make test` installs) and pyproject's `docs` extra name the same pins."""
    lines = (ROOT / "docs" / "requirements.txt").read_text().splitlines()
    pinned = sorted(line for line in lines if line and not line.startswith("#"))
    assert all("==" in pin for pin in pinned), pinned
    extra = re.search(r'^docs = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert extra is not None
    assert sorted(re.findall(r'"([^"]+)"', extra.group(1))) == pinned


def test_a_bench_run_rewrites_the_headline_table_of_measure_it(tmp_path: Path) -> None:
    """1. The committed bench results, reported into a copy of docs/guides/measure.md.
    Result: the block between the markers is this run's targets table; the text around it is unchanged."""
    pytest.importorskip("matplotlib")
    from bench.figures import summary_figures
    from bench.report import DEFAULT_OUT, HEADLINE_MARKERS, HEADLINE_MD, load_records, update_headline

    assert HEADLINE_MD == ROOT / "docs" / "guides" / "measure.md"
    page = tmp_path / "measure.md"
    shutil.copy(HEADLINE_MD, page)
    start, end = HEADLINE_MARKERS
    before = page.read_text()
    head, tail = before.split(start)[0], before.split(end)[1]
    page.write_text(f"{head}{start}\nold figures\n{end}{tail}")
    groups = load_records(DEFAULT_OUT)
    assert update_headline(groups, summary_figures(groups), page=page)
    after = page.read_text()
    block = after.split(start)[1].split(end)[0]
    assert after.startswith(head) and after.endswith(tail)
    assert "old figures" not in block and "From the run of" in block and "| target | measured | verdict |" in block


def test_a_setting_without_a_comment_is_a_warning_of_the_build(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The settings page's descriptions are the comments beside each field: the hook generates the page
    with one field's comment missing and warns, naming it (a warning fails the strict build)."""
    require_part(importlib.util.find_spec("mkdocs"), "mkdocs is not installed (pip install -r docs/requirements.txt)")
    spec = importlib.util.spec_from_file_location("docs_hook", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    described, groups = hook.field_comments(ROOT / "shared" / "settings.py", "Settings")
    assert described["watermark"] and described["port"]
    monkeypatch.setattr(hook, "field_comments", lambda *_: ({**described, "watermark": ""}, groups))
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.vramguard"):
        page = hook.settings_reference()
    assert "`VRAMGUARD_WATERMARK`" in page
    assert [r.getMessage() for r in caplog.records] == [
        "shared/settings.py: setting watermark has no comment beside it to describe it"]
