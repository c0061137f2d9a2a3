"""The import rules of the layout, read from the source (ast, nothing imported): shared/ at the bottom
(neither gateway nor worker, no torch, no FastAPI), the gateway never imports the worker or torch,
the worker never imports the gateway, no two modules import each other, directly or around a longer
circle (an import under `if TYPE_CHECKING:` does not run, so it does not count), and at most
MAX_TOP_FILES Python files at the top of gateway/ and worker/ (STYLE.md: past that, a folder has
outgrown one room)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

# The folders whose modules are vramguard.<folder>.* (vramguard/ links them; vramguard/cli/ is its own).
PACKAGES = {"shared": ROOT / "shared", "gateway": ROOT / "gateway", "worker": ROOT / "worker",
            "cli": ROOT / "vramguard" / "cli"}
MAX_TOP_FILES = 16
# Circles another branch breaks; each entry is the set of modules in one circle. Empty once merged.
KNOWN_CIRCLES: list[frozenset[str]] = [
    frozenset({"vramguard.worker.batch.execute", "vramguard.worker.memory.budget"}),
]


def module_name(package: str, path: Path) -> str:
    parts = list(path.relative_to(PACKAGES[package]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["vramguard", package, *parts])


def modules() -> dict[str, Path]:
    """Every module of the four packages: dotted name -> file."""
    return {module_name(package, path): path
            for package, folder in PACKAGES.items() for path in sorted(folder.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (at module level or in a function), skipping the bodies of
    `if TYPE_CHECKING:` blocks (their `else:` runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """The dotted names module `name` imports at run time: for `from X import Y`, X.Y when that is a
    module of `known`, else X (a relative import resolved against `name`'s package)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in run_time_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """module -> the modules (any, not only ours) it imports at run time."""
    known = modules()
    return {name: imported_names(name, path, set(known)) for name, path in known.items()}


def offenders(graph: dict[str, set[str]], package: str, forbidden: tuple[str, ...]) -> list[str]:
    prefix = f"vramguard.{package}"
    return sorted(f"{module} imports {target}" for module, targets in graph.items()
                  if module == prefix or module.startswith(prefix + ".")
                  for target in targets if any(target == f or target.startswith(f + ".") for f in forbidden))


def test_shared_imports_neither_gateway_nor_worker_nor_torch_nor_fastapi(graph: dict[str, set[str]]) -> None:
    forbidden = ("vramguard.gateway", "vramguard.worker", "vramguard.cli", "torch", "fastapi", "starlette")
    assert offenders(graph, "shared", forbidden) == []


def test_the_gateway_never_imports_the_worker_or_torch(graph: dict[str, set[str]]) -> None:
    assert offenders(graph, "gateway", ("vramguard.worker", "torch")) == []


def test_the_worker_never_imports_the_gateway(graph: dict[str, set[str]]) -> None:
    assert offenders(graph, "worker", ("vramguard.gateway", "fastapi")) == []


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module among ours (Tarjan's algorithm,
    iterative), plus any module that imports itself."""
    ours = {m: sorted(t for t in targets if t in graph) for m, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    found: list[frozenset[str]] = []
    for root in sorted(ours):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                on_stack.append(node)
            if i < len(ours[node]):
                work.append((node, i + 1))
                child = ours[node][i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                component = on_stack[on_stack.index(node):]
                del on_stack[on_stack.index(node):]
                if len(component) > 1 or node in ours[node]:
                    found.append(frozenset(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_two_modules_import_each_other(graph: dict[str, set[str]]) -> None:
    """A package's __init__ that imports its own modules, and a module that imports the names its
    package's __init__ offers, are both edges: such a pair is a circle too."""
    unexpected = [sorted(c) for c in circles(graph) if c not in KNOWN_CIRCLES]
    assert unexpected == []


def test_the_circle_finder_finds_a_circle_through_three_modules() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


def test_an_import_under_type_checking_does_not_count() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    assert sorted(n.names[0].name for n in run_time_imports(tree) if isinstance(n, ast.Import)) == ["b", "c"]


@pytest.mark.parametrize("folder", ["gateway", "worker"])
def test_a_top_folder_holds_at_most_16_python_files(folder: str) -> None:
    files = sorted(p.name for p in (ROOT / folder).glob("*.py"))
    assert len(files) <= MAX_TOP_FILES, files
