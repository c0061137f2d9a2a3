"""The generation peer: LitServe streaming SmolLM2-135M (`stream=True`), with the same model
files, the same greedy decoding (it stops at the end token or max_tokens) and the same decode
code as a vramguard worker: each request's `predict` runs the worker's Engine
(worker/generate/engine.py) for its one sequence and yields a chunk per decoded token.
LitServe's streaming loop serves one request at a time per worker (no batching). Runs from the
peer venv (bench/.venv-peer), PYTHONPATH = repo root.

Request: POST /predict {"prompt": str, "max_tokens": int}; response: one JSON line per token,
{"text": str}. Environment: BENCH_PORT, BENCH_TORCH_THREADS.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import litserve as ls


class GenerateAPI(ls.LitAPI):  # type: ignore[misc]  # litserve is in the peer venv only
    """decode_request -> predict (yields token ids, one per decode step) -> encode_response (text)."""

    def setup(self, device: str) -> None:
        import torch

        from vramguard.shared.settings import Settings
        from vramguard.worker.generate.causal_lm import CausalLMBackend

        torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
        settings = Settings(model="smollm2", served_models=["smollm2"])
        self.backend = CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)
        self.backend.load()

    def decode_request(self, request: dict[str, object]) -> tuple[list[int], int]:
        return self.backend.prompt_ids(str(request["prompt"]), {}), int(str(request["max_tokens"]))

    def predict(self, x: tuple[list[int], int]) -> Iterator[int]:
        from bench.peers.greedy import done_after
        from vramguard.worker.generate.engine import Engine
        from vramguard.worker.generate.sampling import SamplingParams
        from vramguard.worker.generate.sequence import Sequence

        prompt_ids, max_tokens = x
        engine = Engine(self.backend)
        seq = Sequence(request_id="litserve", entry_id="0", reply_to="", deadline_ms=0,  # type: ignore[arg-type]
                       prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=SamplingParams(0.0, 1.0, 0))
        engine.add(seq)
        while not done_after(seq.generated, max_tokens, self.backend.eos_token_ids):  # greedy, as the worker stops
            if engine.step():
                yield seq.generated[-1]

    def encode_response(self, output: Iterator[int]) -> Iterator[dict[str, str]]:
        for token in output:
            yield {"text": self.backend.detokenize([token])}


def main() -> None:
    try:
        api, serve_args = GenerateAPI(stream=True), {}  # litserve >= 0.2.11: stream is the API's
    except TypeError:
        api, serve_args = GenerateAPI(), {"stream": True}
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=600, **serve_args)
    server.run(port=int(os.environ["BENCH_PORT"]), host="127.0.0.1", num_api_servers=1, log_level="warning",
               generate_client_file=False)


if __name__ == "__main__":
    main()
