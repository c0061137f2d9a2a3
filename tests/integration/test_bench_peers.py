"""The benchmark's reference servers run the same backend code as a vramguard worker; when that
code's contract changes they must still serve, or `make bench` stops halfway. Each is started as
`make bench` starts it and must answer one request of the corpus with a minilm embedding."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.services import PEER_PYTHON, ProcessService, litserve, naive

pytestmark = pytest.mark.slow
TEXTS = ["How do I reset my password?"]


def answers_an_embedding(service: ProcessService) -> None:
    service.start()
    try:
        reply = httpx.post(service.infer_url, json={"inputs": TEXTS}, timeout=60)
    finally:
        service.stop()
    assert reply.status_code == 200, reply.text
    (vector,) = reply.json()["outputs"]
    assert len(vector) == 384 and np.isclose(np.linalg.norm(vector), 1.0, atol=1e-3)  # minilm: L2-normalised


def test_the_naive_endpoint_serves_minilm(tmp_path: Path) -> None:
    answers_an_embedding(naive(tmp_path, torch_threads=1))


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="LitServe lives in bench/.venv-peer, which `make bench` builds")
@pytest.mark.parametrize("max_batch_size", [1, 8])  # LitServe skips batch() at 1: both paths
def test_litserve_serves_minilm(tmp_path: Path, max_batch_size: int) -> None:
    answers_an_embedding(litserve(tmp_path, max_batch_size=max_batch_size, max_wait_ms=5.0, torch_threads=1))
