"""vramguard: GPU inference behind a Redis Streams broker. What a user's model package imports:

    from vramguard import InvalidInputError, ModelBackend, ModelConfig

`ModelBackend` (defined in vramguard/worker/backend.py) documents every method; a model is described
to the gateway by its entry in a TOML models file (vramguard.shared.models `ModelSpec`). These names
are loaded on first use (PEP 562 module `__getattr__`), so `import vramguard.gateway` does not pull in
the worker's code, and `from vramguard import ModelBackend` never imports torch or FastAPI. See
docs/guides/own-model.md.

The service's own packages are `vramguard.gateway`, `vramguard.worker` and `vramguard.shared`. In a
source checkout they are the top-level folders `gateway/`, `worker/` and `shared/` (the layout the
design card names), reached through the symbolic links `vramguard/gateway`, `vramguard/worker` and
`vramguard/shared`; a wheel copies them into this package (pyproject.toml `package-dir`). No
top-level `worker`, `shared` or `gateway` is installed, so vramguard installs beside any other
distribution of those names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramguard.shared.errors import InvalidInputError, ModelError
    from vramguard.shared.models import InputKind, ModelConfig, ModelSpec, OutputSpec
    from vramguard.shared.settings import Settings
    from vramguard.worker.backend import ModelBackend

_EXPORTS = {
    "InvalidInputError": "vramguard.shared.errors",
    "ModelError": "vramguard.shared.errors",
    "InputKind": "vramguard.shared.models",
    "ModelConfig": "vramguard.shared.models",
    "ModelSpec": "vramguard.shared.models",
    "OutputSpec": "vramguard.shared.models",
    "Settings": "vramguard.shared.settings",
    "ModelBackend": "vramguard.worker.backend",
}

__all__ = ["InputKind", "InvalidInputError", "ModelBackend", "ModelConfig", "ModelError", "ModelSpec", "OutputSpec",
           "Settings"]


def __getattr__(name: str) -> Any:
    """Import an exported name on first use. Raises AttributeError for any other name."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vramguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
