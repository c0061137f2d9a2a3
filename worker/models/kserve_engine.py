"""An external engine that speaks the KServe v2 inference protocol over HTTP: NVIDIA Triton
Inference Server, MLServer, TorchServe's KServe mode. Each batch becomes one
`POST {base_url}/v2/models/{model}/infer` whose input tensor has the batch as its first
dimension; Triton's own dynamic batcher may merge it further. The worker holds no GPU memory.

The v2 REST protocol is spoken directly with httpx rather than through `tritonclient.http`:
the latter runs on gevent, whose hub does not mix with the worker's thread pool, and the wire
protocol is the same for every v2 server.

    [doubler]
    backend = "vramguard.worker.models.kserve_engine:KServeV2Backend"
    description = "a model on the Triton server"
    input_kind = "json"
    output = { kind = "tensor", datatype = "float32", shape = [4] }
    options = { base_url = "http://127.0.0.1:8000", model = "doubler", input = "INPUT", output = "OUTPUT",
                shape = "4", timeout_s = 30 }

Each wire input is one row: a (nested) JSON list of numbers of `options.shape` (comma-separated
sizes), sent as FP32; each output is that row of the `options.output` tensor, float32. Errors as
worker/models/engine_http.py maps them: the engine down is 503 for the batch, and the next batch
tries again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx
import numpy as np

from vramguard.shared.errors import InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.models.engine_http import post_json


class KServeV2Backend:
    """JSON rows of FP32 in, rows of the engine's output tensor out; one HTTP call per forward."""

    max_item_cost = 1  # the engine plans its own memory

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        options = settings.spec_for(settings.model).options
        missing = [k for k in ("base_url", "model", "input", "output", "shape") if not isinstance(options.get(k), str)]
        if missing:
            raise ValueError(f"model {settings.model!r}: options {missing} are required (strings)")
        self.name = settings.model
        self.device = device
        self.url = f"{str(options['base_url']).rstrip('/')}/v2/models/{options['model']}/infer"
        self.input_name, self.output_name = str(options["input"]), str(options["output"])
        self.row_shape = tuple(int(size) for size in str(options["shape"]).split(","))
        self.timeout_s = float(options.get("timeout_s", 30.0))
        self._client: httpx.Client | None = None

    def load(self) -> None:
        self._client = httpx.Client(timeout=self.timeout_s)

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        """Rows -> float32 arrays of row_shape. Raises InvalidInputError naming the input otherwise."""
        if parameters:
            raise InvalidInputError(f"model {self.name!r} takes no parameters, got {sorted(parameters)}")
        rows: list[object] = []
        for i, value in enumerate(inputs):
            try:
                row = np.asarray(value, dtype=np.float32)
            except (TypeError, ValueError):
                row = None
            if row is None or row.shape != self.row_shape or not np.isfinite(row).all():
                raise InvalidInputError(f"inputs[{i}]: a list of finite numbers of shape {list(self.row_shape)}")
            rows.append(row)
        return rows

    def item_cost(self, item: object) -> int:
        return 1

    def sample_item(self, cost: int) -> object:
        return np.zeros(self.row_shape, dtype=np.float32)

    def collate(self, items: Sequence[object]) -> object:
        return np.stack([np.asarray(item) for item in items])

    def forward(self, batch: object) -> object:
        """One v2 infer call for the batch: float32[n, ...] of the output tensor."""
        assert isinstance(batch, np.ndarray) and self._client is not None
        body = {"inputs": [{"name": self.input_name, "shape": list(batch.shape), "datatype": "FP32",
                            "data": batch.ravel().tolist()}],
                "outputs": [{"name": self.output_name}]}
        answer = post_json(self._client, self.url, body)
        try:
            tensor = next(o for o in answer["outputs"] if o["name"] == self.output_name)  # type: ignore[index]
            return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        except (StopIteration, KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"the engine's answer has no usable {self.output_name!r} tensor: {exc!r}") from None

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape[0] != n_items:
            raise ModelError(f"engine returned {outputs.shape[0]} rows for {n_items} inputs")
        return list(outputs)

    def encode(self, item: object, output: object) -> object:
        return output

    def example_inputs(self) -> list[object]:
        return [np.zeros(self.row_shape).tolist(), np.ones(self.row_shape).tolist()]
