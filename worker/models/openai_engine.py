"""An external engine behind vramguard's queue: each batch is forwarded to an OpenAI-compatible
`POST {base_url}/embeddings` (vLLM, Ollama, llama.cpp's server, text-embeddings-inference), so
the worker is a client, not a GPU holder; admission, deadlines, batching and crash survival
stay vramguard's.

Use it from a models file (options are this backend's own settings):

    [embedder]
    backend = "vramguard.worker.models.openai_engine:OpenAIEmbeddingsBackend"
    description = "bge-small on the vLLM server"
    input_kind = "text"
    output = { kind = "tensor", datatype = "float32", shape = [-1] }
    options = { base_url = "http://127.0.0.1:8001/v1", model = "bge-small", timeout_s = 30 }

Errors (worker/models/engine_http.py): the engine unreachable, timing out or answering 5xx/429
is UnavailableError (503 for the requests of that batch, no item-by-item retry) naming the
engine and the cause; the next batch tries again, so service resumes as soon as the engine is
back. 400/413/422 from the engine is InvalidInputError (422 for the refused input alone); any
other answer is ModelError (500).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx
import numpy as np

from vramguard.shared.errors import InvalidInputError, ModelError
from vramguard.shared.models import ModelConfig
from vramguard.shared.settings import Settings
from vramguard.worker.models.engine_http import post_json


class OpenAIEmbeddingsBackend:
    """Text in, the engine's embedding (float32[d]) out; one HTTP call per forward."""

    max_item_cost = 1  # the engine plans its own memory; to vramguard every text costs the same

    def __init__(self, config: ModelConfig, device: str, settings: Settings) -> None:
        options = settings.spec_for(settings.model).options
        base_url, engine_model = options.get("base_url"), options.get("model")
        if not isinstance(base_url, str) or not isinstance(engine_model, str):
            raise ValueError(f"model {settings.model!r}: options.base_url and options.model (strings) are required")
        self.name = settings.model
        self.device = device  # the worker's own device holds nothing; the engine has the GPU
        self.url = base_url.rstrip("/") + "/embeddings"
        self.engine_model = engine_model
        self.timeout_s = float(options.get("timeout_s", 30.0))
        self._client: httpx.Client | None = None

    def load(self) -> None:
        self._client = httpx.Client(timeout=self.timeout_s)

    def decode(self, inputs: list[object], parameters: Mapping[str, object]) -> list[object]:
        if parameters:
            raise InvalidInputError(f"model {self.name!r} takes no parameters, got {sorted(parameters)}")
        for i, text in enumerate(inputs):
            if not isinstance(text, str) or not text.strip():
                raise InvalidInputError(f"inputs[{i}]: non-empty strings only")
        return list(inputs)

    def item_cost(self, item: object) -> int:
        return 1

    def sample_item(self, cost: int) -> object:
        return "a"

    def collate(self, items: Sequence[object]) -> object:
        return list(items)

    def forward(self, batch: object) -> object:
        """One POST for the whole batch; float32[n, d] in input order. Raises as engine_http.post_json does."""
        assert isinstance(batch, list) and self._client is not None
        return _embeddings(post_json(self._client, self.url, {"model": self.engine_model, "input": batch}), len(batch))

    def split(self, outputs: object, n_items: int) -> list[object]:
        assert isinstance(outputs, np.ndarray)
        if outputs.shape[0] != n_items:
            raise ModelError(f"engine returned {outputs.shape[0]} embeddings for {n_items} inputs")
        return list(outputs)

    def encode(self, item: object, output: object) -> object:
        return output

    def example_inputs(self) -> list[object]:
        return ["warm up the engine", "a second input"]


def _embeddings(answer: object, n_items: int) -> np.ndarray:
    """The `data[].embedding` of an OpenAI embeddings answer, ordered by `index`: float32[n, d]."""
    try:
        data = sorted(answer["data"], key=lambda d: int(d["index"]))  # type: ignore[index]
        array = np.asarray([d["embedding"] for d in data], dtype=np.float32)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"the engine's answer is not an OpenAI embeddings response: {exc!r}") from None
    if array.ndim != 2 or array.shape[0] != n_items:
        raise ModelError(f"the engine returned embeddings of shape {array.shape} for {n_items} inputs")
    return array
