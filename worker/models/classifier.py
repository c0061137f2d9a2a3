"""Labels and scores from a local classification folder in the Hugging Face layout, loaded by
transformers' own loaders (offline): `TextClassifierBackend` (*ForSequenceClassification and its
tokenizer) and `ImageClassifierBackend` (*ForImageClassification and its image processor).

Output per input: {"labels": [{"label", "index", "probability"}, ... top_k]}, best first; the
labels are the config's id2label; probabilities a softmax over the logits (a sigmoid per label
for a config whose problem_type is multi_label_classification). Parameters: top_k (default 5, at
most the label count); text also takes truncate (the token window as the embedding models').

options (shared/folders.py writes them): `path` (the folder), `dtype` (float32, float16, bfloat16).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vramguard.shared.errors import InputTooLargeError, InputTooLongError, InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig, ModelSpec
from vramguard.shared.settings import Settings
from vramguard.worker.models.efficientnet import (
    DECODE_ERRORS,
    FORMAT_NAMES,
    FORMATS,
    MAX_PIXELS,
    check_decoding_cost,
    example_images,
    to_rgb,
)
from vramguard.worker.models.embedding import special_tokens
from vramguard.worker.models.labels import top_labels

DEFAULT_TOP_K = 5


@dataclass(frozen=True, slots=True)
class ClassifyItem:
    """One decoded input: token ids (list[int]) or pixels (float tensor [3, H, W]), and its request's top_k."""

    data: list[int] | torch.Tensor
    top_k: int = DEFAULT_TOP_K


class _Classifier:
    """What both classifiers share: the catalogue entry, loading options, scoring and encoding."""

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        spec: ModelSpec = settings.spec_for(settings.model)
        self.name = spec.name
        if config.params:
            raise ValueError(f"{self.name} takes no params, got {sorted(config.params)}")
        if device == "sim":
            raise ValueError(f"{self.name} runs on cuda or cpu; the simulated device is for the synthetic model")
        self.device = device
        self.spec = spec
        self.folder = Path(str(spec.options.get("path", "")))
        self.dtype = getattr(torch, str(spec.options.get("dtype", "float32")))
        self._model: Any = None
        self.labels: list[str] = []
        self._multi_label = False

    def _loaded(self, model: Any) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self._model = model.to(self.device).eval()
        id2label = model.config.id2label or {}
        self.labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(int(model.config.num_labels))]
        self._multi_label = model.config.problem_type == "multi_label_classification"

    def _top_k(self, parameters: Mapping[str, object]) -> int:
        top_k = parameters.get("top_k", DEFAULT_TOP_K)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise InvalidInputError(f"parameters.top_k must be a positive integer (at most {len(self.labels)} "
                                    "labels are returned)")
        return min(top_k, len(self.labels))

    def forward(self, batch: object) -> object:
        assert isinstance(batch, dict)
        with torch.inference_mode():
            return self._model(**batch).logits.float().cpu().numpy()  # float32[n, labels]

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape != (n_items, len(self.labels)):
            raise ModelError(f"{self.name} returned shape {outputs.shape} for {n_items} items")
        return list(outputs)

    def encode(self, item: object, output: object) -> object:
        assert isinstance(item, ClassifyItem) and isinstance(output, np.ndarray)
        return {"labels": top_labels(output, self.labels, item.top_k, multi_label=self._multi_label)}


class TextClassifierBackend(_Classifier):
    """A *ForSequenceClassification folder: one text in, its labels out."""

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        super().__init__(config, device, settings)
        self._tokenizer: Any = None
        self.max_tokens = int(self.spec.max_input_tokens or 512)
        self.max_input_chars = self.spec.max_input_chars or 0
        self._special = 2  # tokens the tokenizer adds around one text; set at load

    def load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never reach the hub
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        self._loaded(AutoModelForSequenceClassification.from_pretrained(self.folder, dtype=self.dtype,
                                                                        local_files_only=True))
        self.max_tokens = min(self.max_tokens, int(self._tokenizer.model_max_length))
        self._special = sum(map(len, special_tokens(self._tokenizer)))

    @property
    def max_item_cost(self) -> int:
        return self.max_tokens

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """Each text -> a ClassifyItem of its token ids (special tokens included). Raises
        InvalidInputError (not a string, no tokens, bad top_k) or InputTooLongError (over the window
        without parameters.truncate), naming the input."""
        top_k, truncate = self._top_k(parameters), bool(parameters.get("truncate", False))
        return [ClassifyItem(self._token_ids(index, value, truncate), top_k) for index, value in enumerate(inputs)]

    def _token_ids(self, index: int, value: object, truncate: bool) -> list[int]:
        if not isinstance(value, str):
            raise InvalidInputError(f"inputs[{index}]: {self.name} takes strings")
        if len(value) > self.max_input_chars:
            if not truncate:
                raise InputTooLongError(f"inputs[{index}]: {len(value)} characters, more than the "
                                        f"{self.max_input_chars} a {self.max_tokens}-token input may span; "
                                        f"{InputTooLongError.HINT}")
            value = value[: self.max_input_chars]
        ids = self._tokenizer(value, verbose=False)["input_ids"]
        if len(ids) <= self._special:
            raise InvalidInputError(f"inputs[{index}]: no tokens (empty, or only invisible or control characters)")
        if len(ids) > self.max_tokens:
            if not truncate:
                raise InputTooLongError(f"inputs[{index}]: {len(ids)} tokens, more than the model's "
                                        f"{self.max_tokens}; {InputTooLongError.HINT}")
            ids = self._tokenizer(value, truncation=True, max_length=self.max_tokens, verbose=False)["input_ids"]
        return [int(t) for t in ids]

    def item_cost(self, item: object) -> int:
        assert isinstance(item, ClassifyItem) and isinstance(item.data, list)
        return len(item.data)

    def sample_item(self, cost: int) -> object:
        prefix, suffix = special_tokens(self._tokenizer)
        a_ids = self._tokenizer("a", add_special_tokens=False)["input_ids"] or [self._tokenizer.unk_token_id or 0]
        return ClassifyItem([*prefix, *[int(a_ids[0])] * max(1, cost - len(prefix) - len(suffix)), *suffix])

    def collate(self, items: Sequence[object]) -> object:
        """Items -> right-padded input_ids and attention_mask [n, longest] (token_type_ids where the
        tokenizer makes them) on the device."""
        rows = [item.data for item in items if isinstance(item, ClassifyItem) and isinstance(item.data, list)]
        if len(rows) != len(items):
            raise ModelError(f"{self.name}: collate got an item that decode did not make")
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), int(self._tokenizer.pad_token_id or 0), dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in self._tokenizer.model_input_names:
            tensors["token_type_ids"] = torch.zeros_like(input_ids)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def example_inputs(self) -> list[object]:
        return ["warm up the tokenizer and the model", "a second, somewhat longer sentence for the warmup batch"]


class ImageClassifierBackend(_Classifier):
    """A *ForImageClassification folder: one encoded image in, its labels out. Images are decoded
    with efficientnet.py's bounds (formats, pixels, decoded bytes, JPEG scans), then the folder's
    image processor resizes and normalises them; every item has the same size, so its cost is 1."""

    max_item_cost = 1

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        super().__init__(config, device, settings)
        self._processor: Any = None
        self._pixels_shape: tuple[int, ...] = ()

    def load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never reach the hub
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        self._processor = AutoImageProcessor.from_pretrained(self.folder, local_files_only=True)
        self._loaded(AutoModelForImageClassification.from_pretrained(self.folder, dtype=self.dtype,
                                                                     local_files_only=True))
        self._pixels_shape = tuple(self._pixels(Image.new("RGB", (64, 64), (128, 128, 128))).shape)

    def _pixels(self, image: Image.Image) -> torch.Tensor:
        return self._processor(images=image, return_tensors="pt")["pixel_values"][0].to(self.dtype)  # type: ignore[no-any-return]

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """Encoded images -> ClassifyItems of processed pixels. Raises InvalidInputError (422) for
        bytes that are not a decodable image of FORMATS or a bad top_k, InputTooLargeError (413)
        past efficientnet.py's bounds."""
        top_k = self._top_k(parameters)
        items: list[object] = []
        for index, blob in enumerate(inputs):
            if not isinstance(blob, bytes):
                raise InvalidInputError(f"inputs[{index}]: {self.name} takes encoded image bytes")
            items.append(ClassifyItem(self._pixels(_open_rgb(blob, index)), top_k))
        return items

    def item_cost(self, item: object) -> int:
        return 1

    def sample_item(self, cost: int) -> object:
        return ClassifyItem(torch.zeros(self._pixels_shape, dtype=self.dtype))

    def collate(self, items: Sequence[object]) -> object:
        pixels = [item.data for item in items if isinstance(item, ClassifyItem) and isinstance(item.data, torch.Tensor)]
        if len(pixels) != len(items):
            raise ModelError(f"{self.name}: collate got an item that decode did not make")
        return {"pixel_values": torch.stack(pixels).to(self.device)}

    def example_inputs(self) -> list[object]:
        return example_images()


def _open_rgb(blob: bytes, index: int) -> Image.Image:
    """Encoded image -> 8-bit RGB, decoded within efficientnet.py's bounds (see its module docstring)."""
    try:
        with Image.open(io.BytesIO(blob), formats=FORMATS) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise InputTooLargeError(
                    f"inputs[{index}]: image of {width}x{height} pixels; at most {MAX_PIXELS} pixels are decoded")
            check_decoding_cost(image, blob, index)
            return to_rgb(image)
    except Image.DecompressionBombError as exc:
        raise InputTooLargeError(f"inputs[{index}]: {exc}") from None
    except UnidentifiedImageError:
        raise InvalidInputError(
            f"inputs[{index}]: not an image in a format this model takes ({FORMAT_NAMES})") from None
    except DECODE_ERRORS:  # Pillow's own text names internals: not for clients
        raise InvalidInputError(f"inputs[{index}]: a truncated or corrupt image file") from None
