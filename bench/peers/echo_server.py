"""The serving-cost floor: a FastAPI endpoint that parses the same JSON body as vramguard's
native route ({"inputs": [...]}, validated by a pydantic model) and answers at once, with no
broker and no model. BENCH_OUTPUT_DIM 0 echoes the inputs; N answers a float32 row of N values
per input, rendered as minilm's replies are (orjson, numpy rows). Environment: BENCH_PORT,
BENCH_OUTPUT_DIM."""

from __future__ import annotations

import os

import numpy as np
import orjson
import uvicorn
from fastapi import FastAPI, Response
from pydantic import BaseModel

DIM = int(os.environ.get("BENCH_OUTPUT_DIM", "0"))
ROW = np.random.default_rng(0).standard_normal(DIM).astype(np.float32)
app = FastAPI()


class InferRequest(BaseModel):
    inputs: list[object]


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/predict")
async def predict(request: InferRequest) -> Response:
    outputs = [ROW for _ in request.inputs] if DIM else request.inputs
    return Response(orjson.dumps({"outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY),
                    media_type="application/json")


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning", access_log=False)
