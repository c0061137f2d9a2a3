"""The generation baseline: a naive FastAPI endpoint that runs transformers' `generate` for each
request inside an `async def` handler (the seed's "async def predict" server: one request at a
time, the event loop blocked meanwhile). Same model files as the vramguard worker.
Environment: BENCH_PORT, BENCH_TORCH_THREADS."""

from __future__ import annotations

import os

import torch
import uvicorn
from fastapi import FastAPI

from vramguard.shared.settings import Settings
from vramguard.worker.generate.causal_lm import CausalLMBackend

app = FastAPI()
settings = Settings(model="smollm2", served_models=["smollm2"])
backend = CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/v1/completions")
async def completions(body: dict[str, object]) -> dict[str, object]:
    """{"prompt", "max_tokens"} -> the completion (greedy), with usage."""
    ids = backend.prompt_ids(str(body["prompt"]), {})
    with torch.inference_mode():
        out = backend._model.generate(torch.tensor([ids]), max_new_tokens=int(body["max_tokens"]),  # type: ignore[call-overload]
                                      do_sample=False)  # stops at the end token, as the worker does
    tokens = out[0, len(ids):].tolist()
    return {"choices": [{"text": backend.detokenize(tokens)}], "usage": {"completion_tokens": len(tokens)}}


def main() -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
    backend.load()
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
