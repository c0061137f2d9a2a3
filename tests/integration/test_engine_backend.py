"""An external engine behind the queue: the OpenAI-compatible embeddings backend against a stub
engine (a real HTTP server in this process implementing POST /v1/embeddings), with a real gateway
and worker. Engine down: 503 naming the engine, the worker stays up; engine back: served again."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, RedisServer, Stack, free_port, service_env
from vramguard.worker.runner import ExitCode


def stub_embedding(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)) % 97), 1.0]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/embeddings" or not isinstance(body.get("input"), list):
            return self._send(404, {"error": {"message": "not found"}})
        if "refuse me" in body["input"]:
            return self._send(400, {"error": {"message": "input refused by the engine"}})
        data = [{"object": "embedding", "index": i, "embedding": stub_embedding(text)}
                for i, text in enumerate(body["input"])]
        self._send(200, {"object": "list", "model": body["model"], "data": data[::-1]})  # any order: index rules

    def _send(self, status: int, payload: object) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: object) -> None:
        pass


class StubEngine:
    """The stub engine on a fixed port, so that it can go down and come back at the same address."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture
def engine() -> Iterator[StubEngine]:
    stub = StubEngine()
    stub.start()
    yield stub
    stub.stop()


def models_file(folder: Path, port: int) -> Path:
    path = folder / "models.toml"
    path.write_text(
        '[embedder]\nbackend = "vramguard.worker.models.openai_engine:OpenAIEmbeddingsBackend"\n'
        'description = "embeddings from an external engine"\ninput_kind = "text"\n'
        'output = { kind = "tensor", datatype = "float32", shape = [3] }\n'
        f'options = {{ base_url = "http://127.0.0.1:{port}/v1", model = "stub-embedder", timeout_s = 5 }}\n')
    return path


@pytest.mark.slow
async def test_engine_down_is_503_and_service_resumes_when_it_is_back(
    stack: Stack, engine: StubEngine, tmp_path: Path,
) -> None:
    path = models_file(tmp_path, engine.port)
    stack.start_gateway(served_models="embedder", models_file=path)
    worker = stack.start_worker(model="embedder", models_file=path)
    await stack.wait_ready()
    texts = ["one", "two words", "three little words"]
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        ok = await client.post("/v1/models/embedder/infer", json={"inputs": texts})
        assert ok.status_code == 200, ok.text
        assert ok.json()["outputs"] == [stub_embedding(t) for t in texts]

        refused = await client.post("/v1/models/embedder/infer", json={"inputs": ["fine", "refuse me"]})
        assert refused.status_code == 422 and "refused" in refused.json()["error"]["message"]

        engine.stop()
        down = await client.post("/v1/models/embedder/infer", json={"inputs": texts})
        assert down.status_code == 503, down.text
        error = down.json()["error"]
        assert error["code"] == "unavailable"
        assert f"engine at http://127.0.0.1:{engine.port}/v1/embeddings is unreachable" in error["message"]

        engine.start()
        back = await client.post("/v1/models/embedder/infer", json={"inputs": texts})
        assert back.status_code == 200, back.text
        assert back.json()["outputs"] == [stub_embedding(t) for t in texts]
    assert worker.poll() is None, stack.logs()


@pytest.mark.slow
def test_engine_down_at_start_is_a_start_failure_naming_it(tmp_path: Path, redis_server: RedisServer) -> None:
    port = free_port()  # nothing listens here
    env = service_env(redis_server.url, model="embedder", models_file=models_file(tmp_path, port))
    result = subprocess.run([sys.executable, "-m", "vramguard.worker"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == ExitCode.STARTUP_FAILED, result.stderr
    assert "unavailable at start" in result.stderr and f"127.0.0.1:{port}/v1/embeddings" in result.stderr
