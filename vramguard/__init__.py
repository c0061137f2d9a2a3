"""What a user's model package imports: the model contract and the errors it may raise.

    from vramguard import InvalidInputError, ModelBackend, ModelConfig

`ModelBackend` (defined in worker/backend.py) documents every method; a model is described to
the gateway by its entry in a TOML models file (shared/models.py `ModelSpec`), so this import
never pulls in torch, FastAPI or the worker's runtime. See README "Serve your own model".
"""

from __future__ import annotations

from shared.errors import InvalidInputError, ModelError
from shared.models import InputKind, ModelConfig, ModelSpec, OutputSpec
from shared.settings import Settings
from worker.backend import ModelBackend

__all__ = ["InputKind", "InvalidInputError", "ModelBackend", "ModelConfig", "ModelError", "ModelSpec", "OutputSpec",
           "Settings"]
