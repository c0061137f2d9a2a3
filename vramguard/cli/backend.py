"""`vramguard up --backend mypkg.serving:MyBackend`: serve one class of the user's without writing a
models file by hand. The launcher imports the class (from the folder `up` runs in, as the workers
will), and writes a one-entry models file into the run folder: the model's name is the class's
`name` attribute, its description the first line of its docstring, and what it takes and returns
come from optional class attributes, else the most permissive declaration:

    input_kind = "json"                       # or "text", "bytes"
    output = {"kind": "json"}                 # any msgpack value or numpy array per input
    example = [[0.5, 1.0]]                    # one request's inputs, for the curl line `up` prints

A model that needs more (KServe v2 tensors, parameters, defaults) uses a models file
(VRAMGUARD_MODELS_FILE, docs/guides/own-model.md).
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import ValidationError

from vramguard.shared.models import BACKEND_PATH, BUILTIN, ModelSpec

MODELS_FILE = "backend-models.toml"  # in the run folder


class BackendError(ValueError):
    """The class cannot be imported or described; the message names the path and why."""


def import_backend(path: str, folder: Path) -> type[Any]:
    """The class `path` ("package.module:ClassName") names, imported with `folder` first on sys.path.
    Raises BackendError when the path is malformed, the module does not import or has no such class."""
    if not re.fullmatch(BACKEND_PATH, path):
        raise BackendError(f"--backend {path!r}: expected package.module:ClassName")
    module_name, _, class_name = path.partition(":")
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may raise anything on import; say what and stop
        raise BackendError(f"--backend {path}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(folder))
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise BackendError(f"--backend {path}: {module_name} has no class {class_name}")
    return cls


def describe_backend(path: str, cls: type[Any]) -> ModelSpec:
    """The catalogue entry of `cls` (see the module docstring). Raises BackendError naming the attribute."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str):
        raise BackendError(f"--backend {path}: the class has no `name` attribute (the model's name)")
    if name in BUILTIN:
        raise BackendError(f"--backend {path}: name {name!r} is a built-in model's; choose another")
    doc = (cls.__doc__ or "").strip().splitlines()
    entry: dict[str, Any] = {
        "name": name, "backend": path, "description": doc[0] if doc else f"{path} (vramguard up --backend)",
        "input_kind": getattr(cls, "input_kind", "json"), "output": getattr(cls, "output", {"kind": "json"}),
    }
    if getattr(cls, "example", None) is not None:
        entry["example"] = cls.example
    try:
        return ModelSpec.model_validate(entry)
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise BackendError(f"--backend {path}: {detail}") from None


def write_models_file(run_dir: Path, spec: ModelSpec) -> Path:
    """Write `spec` as the one entry of a models file in `run_dir`; returns its path."""
    entry = spec.model_dump(mode="json", exclude={"name"}, exclude_defaults=True)
    entry.update(backend=spec.backend, description=spec.description, input_kind=spec.input_kind.value,
                 output=spec.output.model_dump(mode="json", exclude_defaults=True) | {"kind": spec.output.kind})
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MODELS_FILE
    path.write_text(tomli_w.dumps({spec.name: entry}))
    return path
