"""The model contract (`ModelBackend`) and device selection. Users import it as `vramguard.ModelBackend`.

A backend turns one request's wire inputs into items, a list of items into one batch, a batch
into outputs, and each item's output back into one wire value. The worker owns everything else
(reading, batching, the memory budget, OOM recovery, deadlines, replies); a backend never
touches Redis. What the model takes and returns is declared as data in its catalogue entry
(shared/models.py `ModelSpec`, or the user's models file), so the gateway never imports it.

Construction: `cls(config, device, settings)`: `config` is the model's ModelConfig (its
`params` are the model's own knobs: refuse unknown ones with ValueError), `device` the torch
device string ("cpu", "cuda"; "sim" for tests), `settings` the process's Settings. Load nothing
heavy here: the worker calls `load` inside its memory measurement.

Threads: every method except the constructor runs on the worker's model threads (worker/modelthreads.py:
one thread unless ModelConfig.max_inflight_batches > 1), never on its event loop. Run no torch
work in the constructor: the thread that first runs it keeps an OpenMP team of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ModelBackend(Protocol):
    """What a model must provide to be served. Per request, then per batch:

        decode(inputs, parameters) -> items            one request; runs before batching
        collate(items) -> batch -> forward(batch) -> outputs -> split(outputs, n) -> per-item outputs
        encode(item, output) -> wire value             one per item

    A batch mixes items of several requests; anything request-specific (its `parameters`) must
    therefore ride on the item that `decode` returns and be read back in `encode`.

    Errors: raise vramguard.InvalidInputError from `decode` for input the model cannot take; that
    request alone gets 422 `invalid_input` with your message, the rest of the batch goes on. Any
    other exception from collate/forward/split/encode is a 500 `model_error` for the items of
    that forward (a failed batch is retried item by item, so one bad item does not fail others).
    torch.cuda.OutOfMemoryError is handled for you: the batch is halved and retried, the
    adaptive batch cap shrinks, and an item that does not fit even alone gets 413
    `input_too_large`. A CUDA error other than OOM restarts the worker; its requests are reclaimed.
    """

    name: str
    device: str  # "cpu", "cuda", "sim": the value given to the constructor

    def load(self) -> None:
        """Load weights onto `device`. Raises on missing weights (the worker exits STARTUP_FAILED).
        The memory planner counts what is allocated here as the weights."""

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """One request's wire inputs -> one item per input, in order; CPU work (parsing, tokenizing,
        image decoding), run on the worker's thread pool.

        `inputs` arrive as the model's InputKind declares: str (text), JSON values (json; lists,
        dicts, finite numbers), or bytes (bytes; already un-based64'd). `parameters` is the
        request's `parameters` object (JSON values), already checked by the gateway against the
        catalogue entry's declared `parameters`. Raises InvalidInputError for an input the model
        cannot take (the request gets 422, or its subclass's status such as 413 input_too_long;
        the rest of the batch goes on).
        """

    def item_cost(self, item: object) -> int:
        """The item's cost in the model's own unit, 1 <= cost <= max_item_cost (tokens for text,
        1 for fixed-size inputs such as an image resized to the model's input size). The memory
        planner measures peak memory per unit of cost; a batch's cost is len(items) x its largest item."""

    @property
    def max_item_cost(self) -> int:
        """The largest cost one item can have (the model's token window; 1 for fixed-size inputs)."""

    def sample_item(self, cost: int) -> object:
        """A decoded item of `cost` (1 <= cost <= max_item_cost), as `decode` would return it; the
        memory planner (worker/memory/budget.py) runs forwards on batches of these at start."""

    def collate(self, items: Sequence[object]) -> object:
        """Items -> one batch ready for `forward` (tensors on `device`, first dimension len(items))."""

    def forward(self, batch: object) -> object:
        """Run the model once (under torch.inference_mode); returns outputs already on the CPU
        (numpy arrays or CPU tensors) whose first dimension is the batch's item count."""

    def split(self, outputs: object, n_items: int) -> list[object]:
        """Outputs -> one per item, in order. Raises ModelError if the count is not `n_items`."""

    def encode(self, item: object, output: object) -> object:
        """One item and its output -> the wire value of that item: msgpack natives (dict, list, str,
        int, float, bool, None) or numpy arrays, matching the declared ModelSpec.output."""

    def example_inputs(self) -> list[object]:
        """Wire inputs (as `decode` receives them) for the warmup and the idle probe. The warmup
        decodes them, runs them as one batch and checks every encoded output against the declared
        ModelSpec.output; a mismatch stops the worker at start (exit code MODEL_INVALID)."""


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
