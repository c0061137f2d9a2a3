"""The registry that maps catalogue names (shared/models.py) to backend implementations."""

from __future__ import annotations

from collections.abc import Callable

from shared.models import CATALOGUE, ModelConfig
from worker.backend import ModelBackend


def _minilm(config: ModelConfig, device: str) -> ModelBackend:
    from worker.models.minilm import MiniLMBackend

    return MiniLMBackend(config, device)


def _synthetic(config: ModelConfig, device: str) -> ModelBackend:
    from worker.models.synthetic import SyntheticBackend

    return SyntheticBackend(config, device)


REGISTRY: dict[str, Callable[[ModelConfig, str], ModelBackend]] = {
    "minilm": _minilm,
    "synthetic": _synthetic,
}
assert REGISTRY.keys() == CATALOGUE.keys(), "every catalogue model needs an implementation"


def create_backend(name: str, config: ModelConfig, device: str) -> ModelBackend:
    """An unloaded backend for catalogue model `name`. Raises KeyError for an unknown name."""
    return REGISTRY[name](config, device)
