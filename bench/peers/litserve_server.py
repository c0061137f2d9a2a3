"""The peer: LitServe serving minilm through its own API, with the same backend code as a
vramguard worker (worker/models/minilm.py: tokenise + forward + pool + normalise), the same
batch size and batch window. Runs from the peer venv (bench/.venv-peer), PYTHONPATH = repo root.

With BENCH_MODEL=instant it serves an instant model instead (no compute: each input echoed, or
with BENCH_OUTPUT_DIM N a float32 row of N values), for the serving-cost suite.

Environment: BENCH_PORT, BENCH_MAX_BATCH_SIZE, BENCH_MAX_WAIT_MS, BENCH_TORCH_THREADS, BENCH_MODEL,
BENCH_OUTPUT_DIM.
"""

from __future__ import annotations

import os

import litserve as ls


class MiniLMAPI(ls.LitAPI):
    """decode_request -> batch (collate) -> predict (forward) -> unbatch -> encode_response."""

    def setup(self, device: str) -> None:
        import torch

        from vramguard.shared.models import ModelConfig
        from vramguard.worker.models.minilm import MiniLMBackend

        torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "2")))
        self.backend = MiniLMBackend(ModelConfig(), "cpu")
        self.backend.load()
        self.backend.forward(self.backend.collate(self.backend.decode(self.backend.example_inputs(), {})))

    def decode_request(self, request: dict) -> list[int]:  # type: ignore[override]
        # Tokenised here, as a vramguard worker's decode does: one text -> its token ids.
        return self.backend.decode([str(request["inputs"][0])], {})[0]  # type: ignore[return-value]

    def batch(self, inputs: list[list[int]]) -> object:  # type: ignore[override]
        return self.backend.collate(inputs)

    def predict(self, x: object) -> object:  # type: ignore[override]
        if isinstance(x, list):  # max_batch_size=1: LitServe skips batch(), x is one text's token ids
            x = self.backend.collate([x])
        return self.backend.forward(x)

    def unbatch(self, output: object) -> list[object]:  # type: ignore[override]
        return list(output)  # type: ignore[call-overload]

    def encode_response(self, output: object) -> dict[str, object]:  # type: ignore[override]
        rows = output if getattr(output, "ndim", 1) == 2 else [output]
        return {"outputs": [row.tolist() for row in rows]}  # type: ignore[union-attr]


class InstantAPI(ls.LitAPI):
    """The instant model: the input echoed, or a fixed float32 row [BENCH_OUTPUT_DIM] per input."""

    def setup(self, device: str) -> None:
        import numpy as np

        dim = int(os.environ.get("BENCH_OUTPUT_DIM", "0"))
        self.row = np.random.default_rng(0).standard_normal(dim).astype(np.float32) if dim else None

    def decode_request(self, request: dict) -> object:  # type: ignore[override]
        return request["inputs"][0]

    def predict(self, x: object) -> object:  # type: ignore[override]
        if self.row is None:
            return x
        return [self.row for _ in x] if isinstance(x, list) else self.row

    def encode_response(self, output: object) -> dict[str, object]:  # type: ignore[override]
        return {"outputs": [output.tolist() if hasattr(output, "tolist") else output]}


def main() -> None:
    api_class = InstantAPI if os.environ.get("BENCH_MODEL") == "instant" else MiniLMAPI
    api = api_class(
        max_batch_size=int(os.environ.get("BENCH_MAX_BATCH_SIZE", "32")),
        batch_timeout=float(os.environ.get("BENCH_MAX_WAIT_MS", "5")) / 1000,
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(port=int(os.environ["BENCH_PORT"]), host="127.0.0.1", num_api_servers=1, log_level="warning",
               generate_client_file=False)


if __name__ == "__main__":
    main()
