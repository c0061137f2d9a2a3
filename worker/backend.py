"""The model plug-in interface (`ModelBackend`) and device selection.

A backend turns one request's wire inputs into items, a list of items into one batch, a batch
into outputs, and outputs back into one wire value per item. The worker owns everything else
(batching, memory, delivery); a backend never touches Redis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ModelBackend(Protocol):
    """What a model must provide to be served. Call order per batch:

    decode (per request, CPU) -> collate (all items) -> forward (one call) -> split -> encode (per item).
    """

    name: str
    device: str  # "cpu", "cuda", ... as resolved by resolve_device

    def load(self) -> None:
        """Load weights onto `device`. Raises on missing weights (the worker then exits non-zero)."""

    def decode(self, inputs: list[object], parameters: Mapping[str, object] | None = None) -> list[object]:
        """One request's wire inputs -> one item per input, validated on the CPU. `parameters`:
        the request's, already checked by the gateway against the catalogue's declaration.

        Raises InvalidInputError for an input the model cannot take (the request gets 422, or its
        subclass's status such as 413 input_too_long; the rest of the batch goes on).
        """

    def item_cost(self, item: object) -> int:
        """The item's cost in the model's own unit (tokens for text, 1 for fixed-size inputs)."""

    @property
    def max_item_cost(self) -> int:
        """The largest cost one item can have (the model's token window; 1 for fixed-size inputs)."""

    def sample_item(self, cost: int) -> object:
        """A decoded item of `cost` (1 <= cost <= max_item_cost), for measuring memory (worker/memory.py)."""

    def collate(self, items: Sequence[object]) -> object:
        """Items -> one batch ready for `forward` (tensors on `device`)."""

    def forward(self, batch: object) -> object:
        """Run the model once; returns outputs already on the CPU whose first dimension is len(items)."""

    def split(self, outputs: object, n_items: int) -> list[object]:
        """Outputs -> one per item, in order. Raises ModelError if the count is not `n_items`."""

    def encode(self, item_output: object) -> object:
        """One item's output -> a wire value (msgpack natives or a numpy array)."""

    def example_inputs(self) -> list[object]:
        """Wire inputs for warmup and the idle probe."""


def resolve_device(setting: str) -> str:
    """Map Settings.device to a torch device string: auto -> cuda when torch sees a GPU, else cpu.

    Raises RuntimeError when "cuda" is asked for and torch sees none.
    """
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("VRAMGUARD_DEVICE=cuda but torch sees no CUDA device")
    return setting


def is_cuda_error(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA failure other than OOM, after which the context is not trusted
    (torch.AcceleratorError in torch >= 2.8; a RuntimeError naming CUDA, cuBLAS or cuDNN before)."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "CUDA driver error")
    )
