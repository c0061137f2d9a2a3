"""The peer: LitServe serving minilm through its own API, with the same backend code as a
vramguard worker (worker/models/minilm.py: tokenise + forward + pool + normalise), the same
batch size and batch window. Runs from the peer venv (bench/.venv-peer), PYTHONPATH = repo root.

Environment: BENCH_PORT, BENCH_MAX_BATCH_SIZE, BENCH_MAX_WAIT_MS, BENCH_TORCH_THREADS.
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


def main() -> None:
    api = MiniLMAPI(
        max_batch_size=int(os.environ.get("BENCH_MAX_BATCH_SIZE", "32")),
        batch_timeout=float(os.environ.get("BENCH_MAX_WAIT_MS", "5")) / 1000,
    )
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(port=int(os.environ["BENCH_PORT"]), host="127.0.0.1", num_api_servers=1, log_level="warning",
               generate_client_file=False)


if __name__ == "__main__":
    main()
