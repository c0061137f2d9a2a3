"""A user's model served without editing vramguard: the example package under examples/ through a
models file, end to end with real processes; and the start-time errors of a model that cannot be
served (exit code MODEL_INVALID and a message that names the problem, never a traceback)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import ROOT, RedisServer, Stack, service_env
from vramguard.worker.runner import ExitCode

EXAMPLE = ROOT / "examples" / "tiny_classifier"
MODELS_FILE = EXAMPLE / "models.toml"


@pytest.fixture
def example_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example package importable by the services, as `pip install` of it would make it."""
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))


@pytest.mark.slow
async def test_example_model_is_served_end_to_end(stack: Stack, example_on_path: None) -> None:
    stack.start_gateway(served_models="tiny", models_file=MODELS_FILE)
    stack.start_worker(model="tiny", models_file=MODELS_FILE)
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        response = await client.post("/v1/models/tiny/infer", json={"inputs": [[0.5] * 8, [-1, 2, 0, 0, 1, 1, 3, 0]]})
        assert response.status_code == 200, response.text
        outputs = np.asarray(response.json()["outputs"], dtype=np.float32)
        assert outputs.shape == (2, 3)
        np.testing.assert_allclose(outputs.sum(axis=1), 1.0, atol=1e-5)

        bad = await client.post("/v1/models/tiny/infer", json={"inputs": [[1, 2, 3]]})
        assert bad.status_code == 422 and "list of 8 numbers" in bad.json()["error"]["message"]

        info = (await client.get("/v1/models/tiny")).json()  # the declared description, no torch in the gateway
        assert info["input_kind"] == "json"
        assert info["output"]["kind"] == "tensor" and info["output"]["shape"] == [3]


def run_worker(env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramguard.worker"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


TENSOR_3 = '{ kind = "tensor", datatype = "float32", shape = [3] }'


def write_models_file(folder: Path, backend: str, output: str = TENSOR_3) -> Path:
    path = folder / "models.toml"
    path.write_text(f'[mine]\nbackend = "{backend}"\ndescription = "test"\ninput_kind = "json"\noutput = {output}\n')
    return path


def test_misspelled_import_path_stops_the_worker_at_start(tmp_path: Path, redis_server: RedisServer) -> None:
    env = service_env(redis_server.url, model="mine",
                      models_file=write_models_file(tmp_path, "tiny_classifer.serving:TinyClassifier"))
    result = run_worker(env)
    assert result.returncode == ExitCode.MODEL_INVALID, result.stderr
    assert "cannot import module 'tiny_classifer.serving'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_missing_class_stops_the_worker_at_start(tmp_path: Path, redis_server: RedisServer,
                                                 example_on_path: None) -> None:
    env = service_env(redis_server.url, model="mine",
                      models_file=write_models_file(tmp_path, "tiny_classifier.serving:TinyClasifier"))
    result = run_worker(env)
    assert result.returncode == ExitCode.MODEL_INVALID, result.stderr
    assert "has no class 'TinyClasifier'" in result.stderr


@pytest.mark.slow
def test_class_breaking_the_contract_stops_the_worker_at_start(tmp_path: Path, redis_server: RedisServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "half_done.py").write_text(
        "class Backend:\n"
        "    def __init__(self, config, device, settings): self.name, self.device = 'mine', device\n"
        "    def load(self): pass\n"
        "    def decode(self, inputs): return inputs\n"  # the contract passes parameters too
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    env = service_env(redis_server.url, model="mine", models_file=write_models_file(tmp_path, "half_done:Backend"))
    result = run_worker(env)
    assert result.returncode == ExitCode.MODEL_INVALID, result.stderr
    assert "does not follow vramguard.ModelBackend" in result.stderr
    assert "decode() takes 1 parameters after self, the contract passes 2" in result.stderr
    assert "no method forward()" in result.stderr


@pytest.mark.slow
def test_outputs_disagreeing_with_the_declaration_stop_the_worker_at_start(
    tmp_path: Path, redis_server: RedisServer, example_on_path: None,
) -> None:
    # The example returns float32[3]; this entry declares float32[4].
    models_file = write_models_file(tmp_path, "tiny_classifier.serving:TinyClassifier",
                                    output='{ kind = "tensor", datatype = "float32", shape = [4] }')
    result = run_worker(service_env(redis_server.url, model="mine", models_file=models_file))
    assert result.returncode == ExitCode.MODEL_INVALID, result.stderr
    assert "encode() returned shape [3], but the catalogue entry declares" in result.stderr


def test_invalid_models_file_stops_a_service_naming_the_entry(tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[mine]\nbackend = "a.b:C"\ndescription = "x"\ninput_kind = "pictures"\n'
                    'output = { kind = "json" }\n')
    result = run_worker(service_env(redis_server.url, model="mine", models_file=path))
    assert result.returncode == 2
    assert "[mine] input_kind" in result.stderr and str(path) in result.stderr


@pytest.mark.slow
async def test_decode_that_raises_or_miscounts_fails_that_request_only(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "miscount.py").write_text(
        "class Backend:\n"
        "    max_item_cost = 1\n"
        "    def __init__(self, config, device, settings): self.name, self.device = 'mine', device\n"
        "    def load(self): pass\n"
        "    def decode(self, inputs, parameters):\n"
        "        if 'boom' in inputs: raise RuntimeError('decoder bug')\n"
        "        return list(inputs[:1])  # drops all but the first\n"
        "    def item_cost(self, item): return 1\n"
        "    def sample_item(self, cost): return 0\n"
        "    def collate(self, items): return list(items)\n"
        "    def forward(self, batch): return batch\n"
        "    def split(self, outputs, n_items): return outputs\n"
        "    def encode(self, item, output): return output\n"
        "    def example_inputs(self): return [1]\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    path = write_models_file(tmp_path, "miscount:Backend", output='{ kind = "json" }')
    stack.start_gateway(served_models="mine", models_file=path)
    stack.start_worker(model="mine", models_file=path)
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        one = await client.post("/v1/models/mine/infer", json={"inputs": [7]})
        assert one.status_code == 200 and one.json()["outputs"] == [7]
        two = await client.post("/v1/models/mine/infer", json={"inputs": [7, 8]})
        assert two.status_code == 500, two.text
        assert "decode returned 1 items for 2 inputs" in two.json()["error"]["message"]
        boom, fine = await asyncio.gather(client.post("/v1/models/mine/infer", json={"inputs": ["boom"]}),
                                          client.post("/v1/models/mine/infer", json={"inputs": [9]}))
        assert boom.status_code == 500 and "RuntimeError: decoder bug" in boom.json()["error"]["message"]
        assert fine.status_code == 200 and fine.json()["outputs"] == [9]


@pytest.mark.slow
def test_model_failing_its_own_warmup_stops_the_worker_at_start(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "broken_forward.py").write_text(
        "class Backend:\n"
        "    max_item_cost = 1\n"
        "    def __init__(self, config, device, settings): self.name, self.device = 'mine', device\n"
        "    def load(self): pass\n"
        "    def decode(self, inputs, parameters): return list(inputs)\n"
        "    def item_cost(self, item): return 1\n"
        "    def sample_item(self, cost): return 0\n"
        "    def collate(self, items): return list(items)\n"
        "    def forward(self, batch): raise ValueError('weights and input disagree')\n"
        "    def split(self, outputs, n_items): return outputs\n"
        "    def encode(self, item, output): return output\n"
        "    def example_inputs(self): return [1]\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    models_file = write_models_file(tmp_path, "broken_forward:Backend", output='{ kind = "json" }')
    result = run_worker(service_env(redis_server.url, model="mine", models_file=models_file))
    assert result.returncode == ExitCode.MODEL_INVALID, result.stderr
    assert "the warmup batch failed" in result.stderr and "weights and input disagree" in result.stderr
