"""The baseline: a naive FastAPI endpoint that calls the model inside the request handler (a
sync `def`, so FastAPI's thread pool runs up to 40 forwards at once; no batching, no limit).
Same backend code as a vramguard worker. Environment: BENCH_PORT, BENCH_TORCH_THREADS."""

from __future__ import annotations

import os

import torch
import uvicorn
from fastapi import FastAPI

from vramguard.shared.models import ModelConfig
from vramguard.worker.models.minilm import MiniLMBackend

app = FastAPI()
backend = MiniLMBackend(ModelConfig(), "cpu")


@app.get("/health")
def health() -> dict[str, str]:
    """200 once the model is loaded (it is loaded before the server starts)."""
    return {"status": "ok"}


@app.post("/predict")
def predict(body: dict[str, list[str]]) -> dict[str, object]:
    """{"inputs": [text, ...]} -> {"outputs": [float[384], ...]}, one forward per request."""
    outputs = backend.forward(backend.collate(backend.decode(list(body["inputs"]), {})))
    return {"outputs": outputs.tolist()}  # type: ignore[attr-defined]


def main() -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "2")))
    backend.load()
    backend.forward(backend.collate(backend.decode(backend.example_inputs(), {})))
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
