"""The registry that maps catalogue names (shared/models.py) to backend implementations."""

from __future__ import annotations

from collections.abc import Callable

from shared.models import CATALOGUE, ModelConfig
from shared.settings import Settings
from worker.backend import ModelBackend


def _minilm(config: ModelConfig, device: str, settings: Settings) -> ModelBackend:
    from worker.models.minilm import MiniLMBackend

    return MiniLMBackend(config, device)


def _synthetic(config: ModelConfig, device: str, settings: Settings) -> ModelBackend:
    from worker.models.synthetic import SyntheticBackend

    return SyntheticBackend(config, device, fault_injection=settings.fault_injection,
                            fault_file=settings.fault_cuda_error_file)


REGISTRY: dict[str, Callable[[ModelConfig, str, Settings], ModelBackend]] = {
    "minilm": _minilm,
    "synthetic": _synthetic,
}
assert REGISTRY.keys() == CATALOGUE.keys(), "every catalogue model needs an implementation"


def create_backend(settings: Settings, device: str) -> ModelBackend:
    """An unloaded backend for `settings.model` on `device`. Raises KeyError for an unknown name,
    ValueError for params the model does not take."""
    return REGISTRY[settings.model](settings.model_config_for(settings.model), device, settings)
