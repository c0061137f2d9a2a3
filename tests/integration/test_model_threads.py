"""Where the model runs in a real worker process: every call into the backend (load, warmup,
decode, item_cost, collate, forward, split, encode) on the worker's model thread, one thread per
concurrent forward, never the event loop's thread or asyncio's default pool (a second thread
running torch on the CPU gets an OpenMP team of its own and slows every forward:
worker/modelthreads.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack

BACKEND = '''
"""Reports the threads its methods ran on; the forward is a real (small) torch op."""
import threading

import numpy as np
import torch


class ThreadReport:
    name = "threads"
    max_item_cost = 1

    def __init__(self, config, device, settings):
        self.device = device
        self.seen = set()  # (method, thread name)

    def _note(self, method):
        self.seen.add((method, threading.current_thread().name))

    def load(self):
        self._note("load")
        self.weight = torch.ones(4, 4)

    def decode(self, inputs, parameters):
        self._note("decode")
        return [float(x) for x in inputs]

    def item_cost(self, item):
        self._note("item_cost")
        return 1

    def sample_item(self, cost):
        return 0.0

    def collate(self, items):
        self._note("collate")
        return torch.tensor(items).unsqueeze(1).repeat(1, 4)

    def forward(self, batch):
        self._note("forward")
        return (batch @ self.weight).numpy()

    def split(self, outputs, n_items):
        self._note("split")
        return list(outputs)

    def encode(self, item, output):
        self._note("encode")
        return {"threads": sorted(f"{method}@{thread}" for method, thread in self.seen)}

    def example_inputs(self):
        return [1.0, 2.0]
'''


async def serve_thread_report(stack: Stack, folder: Path, monkeypatch: pytest.MonkeyPatch,
                              **worker_settings: object) -> None:
    """The backend above as model `threads` from a models file in `folder`: a gateway and one
    worker (with `worker_settings`), ready."""
    (folder / "thread_report.py").write_text(BACKEND)
    models = folder / "models.toml"
    models.write_text('[threads]\nbackend = "thread_report:ThreadReport"\ndescription = "test"\n'
                      'input_kind = "json"\noutput = { kind = "json", keys = ["threads"] }\n'
                      'defaults = { max_batch_size = 8, max_wait_ms = 2 }\n')
    monkeypatch.setenv("PYTHONPATH", str(folder))  # importable by the services, as a pip install makes it
    stack.start_gateway(served_models="threads", models_file=models)
    stack.start_worker(model="threads", models_file=models, **worker_settings)
    await stack.wait_ready()


async def threads_seen(stack: Stack, requests: int) -> set[str]:
    """The union of the `method@thread` pairs the worker reports over `requests` concurrent requests."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        responses = await asyncio.gather(*(client.post("/v1/models/threads/infer", json={"inputs": [i, i + 1]})
                                           for i in range(requests)))
    seen: set[str] = set()
    for response in responses:
        assert response.status_code == 200, response.text
        seen.update(*(output["threads"] for output in response.json()["outputs"]))
    return seen


@pytest.mark.slow
async def test_every_backend_call_runs_on_the_one_model_thread(stack: Stack, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    await serve_thread_report(stack, tmp_path, monkeypatch)
    seen = await threads_seen(stack, 24)
    methods = {pair.split("@")[0] for pair in seen}
    assert methods == {"load", "decode", "item_cost", "collate", "forward", "split", "encode"}
    assert {pair.split("@")[1] for pair in seen} == {"model_0"}, sorted(seen)


@pytest.mark.slow
async def test_two_concurrent_forwards_use_two_model_threads_at_most(stack: Stack, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    await serve_thread_report(stack, tmp_path, monkeypatch, models__threads__max_inflight_batches=2)
    threads = {pair.split("@")[1] for pair in await threads_seen(stack, 48)}
    assert threads and threads <= {"model_0", "model_1"}, sorted(threads)
