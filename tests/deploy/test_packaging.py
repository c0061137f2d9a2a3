"""What `pip install` puts on a user's machine: one top-level package, `vramguard`, so installing it
beside other distributions that own a top-level `worker`, `shared` or `gateway` breaks neither; and
no source file reaches the service's packages by their folder names (which would load a second copy
of every module, with its own classes, in a source checkout)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

FOLDERS = ("gateway", "worker", "shared")
SOURCE = ("pyproject.toml", "README.md", "vramguard", *FOLDERS)


def build_wheel(source: Path, out: Path) -> Path:
    """A wheel of the project at `source`, built without network (setuptools from this venv)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob(f"{source.name.replace('-', '_')}-*.whl")
    return wheel


def other_distribution(tmp: Path, package: str) -> Path:
    """A source tree for a distribution named `<package>-dist` that owns the top-level `package`."""
    tree = tmp / f"{package}-dist"
    (tree / package).mkdir(parents=True)
    (tree / package / "__init__.py").write_text(f'OWNER = "{package}-dist"\n')
    (tree / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{package}-dist"\nversion = "1.0"\n[tool.setuptools]\npackages = ["{package}"]\n')
    return tree


@pytest.fixture(scope="module")
def vramguard_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: pip builds in place and would leave build/ and *.egg-info in the checkout.
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "vramguard"
    source.mkdir()
    for name in SOURCE:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    return build_wheel(source, tmp / "dist")


def test_the_wheel_installs_one_top_level_package(vramguard_wheel: Path) -> None:
    names = zipfile.ZipFile(vramguard_wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"vramguard"}
    for folder in FOLDERS:  # the links of the checkout became real packages
        assert f"vramguard/{folder}/__init__.py" in names
    assert "vramguard/worker/models/synthetic.py" in names
    assert "vramguard/gateway/observe/status.html" in names


def test_installs_beside_distributions_that_own_worker_shared_and_gateway(vramguard_wheel: Path,
                                                                          tmp_path: Path) -> None:
    others = [build_wheel(other_distribution(tmp_path, name), tmp_path / "dist") for name in FOLDERS]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    *map(str, [*others, vramguard_wheel])], check=True, capture_output=True, timeout=300)
    probe = (
        "import gateway, shared, worker, vramguard\n"
        "from vramguard import ModelBackend, InvalidInputError\n"
        "from vramguard.gateway.app import create_app\n"
        "import vramguard.worker.models.synthetic as synthetic\n"
        f"assert synthetic.__file__.startswith({str(target)!r}), synthetic.__file__\n"
        "print(worker.OWNER, shared.OWNER, gateway.OWNER, create_app.__module__)\n"
    )
    # Outside the checkout, with only the target folder ahead of the venv's libraries.
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["worker-dist", "shared-dist", "gateway-dist", "vramguard.gateway.app"]


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports in one Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_source_imports_the_folders_by_their_own_names() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    offenders = {name: sorted(imported_modules(ROOT / name) & set(FOLDERS))
                 for name in tracked.stdout.split() if not name.startswith("vramguard/")}
    assert {name: bad for name, bad in offenders.items() if bad} == {}
