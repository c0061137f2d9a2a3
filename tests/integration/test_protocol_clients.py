"""The standard clients, unmodified, against real processes: `tritonclient[http]` (sync and aio,
JSON and binary tensors) over KServe v2, and the `openai` client over /v1/embeddings and
/v1/models, with and without an API key. Embeddings must equal the native route's."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tests.helpers import ROOT, RedisServer, Stack

pytestmark = pytest.mark.slow
TEXTS = ["How do I reset my password?", "The volcano erupted last night.", "a"]
KEY = "k3y-for-tests"


@pytest.fixture(scope="module")
def stacks(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    """(open, keyed): two gateways on one Redis and key prefix, the second with an API key and a
    queue bound of 2 for synthetic; a minilm worker and a slow synthetic worker (200 ms a batch)."""
    common: dict[str, object] = {"key_prefix": f"p{tmp_path_factory.getbasetemp().name[-8:]}",
                                 "served_models": "minilm,synthetic", "block_ms": 200,
                                 "heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1500, "shutdown_grace_s": 5}
    open_stack = Stack(redis_server.url, tmp_path_factory.mktemp("open"), **common)
    keyed = Stack(redis_server.url, tmp_path_factory.mktemp("keyed"), **common)
    try:
        open_stack.start_gateway()
        keyed.start_gateway(api_key=KEY, models__synthetic__queue_bound=2)
        open_stack.start_worker(model="minilm")
        open_stack.start_worker(model="synthetic", models__synthetic__params='{"batch_ms": 200}',
                                fault_injection=True)
        asyncio.run(open_stack.wait_ready(120))
        yield open_stack, keyed
    finally:
        open_stack.stop()
        keyed.stop()


@pytest.fixture(autouse=True)
def close_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every openai client a test makes (an unclosed socket is a failing warning here)."""
    made: list[openai.OpenAI] = []
    original = openai.OpenAI.__init__

    def init(self: openai.OpenAI, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(openai.OpenAI, "__init__", init)
    yield
    for client in made:
        client.close()


def native(stack: Stack, texts: list[str]) -> np.ndarray:
    response = httpx.post(f"{stack.url}/v1/models/minilm/infer", json={"inputs": texts}, timeout=60)
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["outputs"], dtype=np.float32)


# --- OpenAI ------------------------------------------------------------------------------------


def test_openai_client_every_input_form_and_both_encodings(stacks: tuple[Stack, Stack]) -> None:
    stack, _ = stacks
    expected = native(stack, TEXTS)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    many = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(np.asarray([d.embedding for d in many.data]), expected, atol=1e-5)
    assert many.usage.prompt_tokens == many.usage.total_tokens > len(TEXTS) * 2
    # Asked for explicitly, base64 comes back as the string: little-endian float32.
    raw = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]  # type: ignore[arg-type]
    np.testing.assert_allclose(np.asarray(decoded), expected, atol=1e-6)
    # Unasked, the client requests base64 and decodes it itself.
    one = client.embeddings.create(model="minilm", input=TEXTS[0])
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=1e-5)
    # Token ids of the model's own vocabulary: "hello world" is [7592, 2088] in BERT's.
    by_text = native(stack, ["hello world"])[0]
    ids = client.embeddings.create(model="minilm", input=[7592, 2088], encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, by_text, atol=1e-5)
    assert ids.usage.prompt_tokens == 4  # [CLS] hello world [SEP]
    lists = client.embeddings.create(model="minilm", input=[[7592, 2088], [7592]], encoding_format="float")
    assert [d.index for d in lists.data] == [0, 1]
    np.testing.assert_allclose(lists.data[0].embedding, by_text, atol=1e-5)
    # encoding_format null is OpenAI's default, floats (as null is for every optional parameter).
    null = httpx.post(f"{stack.url}/v1/embeddings",
                      json={"model": "minilm", "input": TEXTS[0], "encoding_format": None})
    assert null.status_code == 200, null.text
    np.testing.assert_allclose(null.json()["data"][0]["embedding"], expected[0], atol=1e-5)


def test_openai_models_list_and_retrieve(stacks: tuple[Stack, Stack]) -> None:
    stack, _ = stacks
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    assert {m.id for m in client.models.list()} == {"minilm", "synthetic"}
    model = client.models.retrieve("minilm")
    assert model.id == "minilm" and model.object == "model"
    body = httpx.get(f"{stack.url}/v1/models").json()
    assert body["models"][0]["config"]["max_batch_size"]  # vramguard's fields are kept


def test_openai_client_with_api_key(stacks: tuple[Stack, Stack]) -> None:
    _, keyed = stacks
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    assert len(good.embeddings.create(model="minilm", input="hi").data[0].embedding) == 384
    assert {m.id for m in good.models.list()} == {"minilm", "synthetic"}
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model="minilm", input="hi")


def test_openai_errors_in_openai_shape(stacks: tuple[Stack, Stack]) -> None:
    stack, _ = stacks
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    long_text = "word " * 300
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model="minilm", input=long_text)
    assert info.value.status_code == 413 and info.value.code == "input_too_long"
    assert "302 tokens" in info.value.message and "256" in info.value.message
    cut = client.embeddings.create(model="minilm", input=long_text, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="minilm", input="hi", dimensions=100)
    assert len(client.embeddings.create(model="minilm", input="hi", dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    # Refused by the worker (no token for the model): 400, OpenAI's status for an invalid request.
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model="minilm", input="\u200b\u200b")
    assert empty.value.status_code == 400 and empty.value.code == "invalid_input"
    assert empty.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_openai_413_speaks_the_openai_requests_terms(stacks: tuple[Stack, Stack]) -> None:
    """The OpenAI body has `input` and a top-level `truncate`; the message names those, never the
    native route's `inputs[i]` or `parameters.truncate` (which this route refuses)."""
    stack, _ = stacks
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    long_text = "word " * 300
    for given, named in ((long_text, "input:"), (["short", long_text], "input[1]:")):
        with pytest.raises(openai.APIStatusError) as info:
            client.embeddings.create(model="minilm", input=given)
        assert info.value.status_code == 413, info.value.message
        assert f"413 - {named}" in info.value.message, info.value.message
        assert '"truncate": true' in info.value.message, info.value.message
        assert "inputs" not in info.value.message and "parameters" not in info.value.message, info.value.message


def outcome_count(stack: Stack, model: str, outcome: str) -> float:
    text = httpx.get(f"{stack.url}/metrics").text
    line = next((ln for ln in text.splitlines() if ln.startswith("vramguard_requests_total")
                 and f'model="{model}"' in ln and f'outcome="{outcome}"' in ln), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_openai_client_does_not_retry_a_504_or_a_model_error(stacks: tuple[Stack, Stack]) -> None:
    stack, _ = stacks
    before = outcome_count(stack, "minilm", "deadline_exceeded")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused",  # default max_retries=2
                           default_headers={"X-Request-Timeout-Ms": "1"})
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model="minilm", input="hi")
    assert info.value.status_code == 504
    assert info.value.response.headers["x-should-retry"] == "false"
    assert outcome_count(stack, "minilm", "deadline_exceeded") == before + 1  # one request, not three
    # A 500 model_error, through the same client's generic POST (which retries 5xx by default).
    before = outcome_count(stack, "synthetic", "model_error")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")  # default max_retries=2, no deadline
    with pytest.raises(openai.InternalServerError) as info:
        client.post("/models/synthetic/infer", body={"inputs": [{"fault": "raise"}]}, cast_to=httpx.Response)
    assert info.value.response.headers["x-should-retry"] == "false", info.value.response.text
    assert outcome_count(stack, "synthetic", "model_error") == before + 1, info.value.response.text


# --- KServe v2 ----------------------------------------------------------------------------------


def _texts_input(binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_), binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_sync_json_and_binary(stacks: tuple[Stack, Stack], binary: bool) -> None:
    stack, _ = stacks
    expected = native(stack, TEXTS)
    client = triton.InferenceServerClient(stack.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("minilm")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata("minilm")
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    outputs = [triton.InferRequestedOutput("embedding", binary_data=binary)]
    result = client.infer("minilm", [_texts_input(binary)], outputs=outputs)
    np.testing.assert_allclose(result.as_numpy("embedding"), expected, atol=1e-5)
    default = client.infer("minilm", [_texts_input(binary)])  # no outputs named: binary_data_output
    np.testing.assert_allclose(default.as_numpy("embedding"), expected, atol=1e-5)
    numbers = triton.InferInput("input", [3], "FP64")
    numbers.set_data_from_numpy(np.array([1.5, 2.0, -3.0]), binary_data=binary)
    echoed = client.infer("synthetic", [numbers]).as_numpy("output")
    np.testing.assert_array_equal(echoed, [1.5, 2.0, -3.0])
    client.close()


async def test_tritonclient_aio_json_and_binary(stacks: tuple[Stack, Stack]) -> None:
    stack, _ = stacks
    expected = native(stack, TEXTS)
    client = triton_aio.InferenceServerClient(stack.url.removeprefix("http://"))
    try:
        for binary in (False, True):
            tensor = triton_aio.InferInput("text", [len(TEXTS)], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_), binary_data=binary)
            outputs = [triton_aio.InferRequestedOutput("embedding", binary_data=binary)]
            result = await client.infer("minilm", [tensor], outputs=outputs)
            np.testing.assert_allclose(result.as_numpy("embedding"), expected, atol=1e-5)
    finally:
        await client.close()


def test_v2_errors_and_statuses(stacks: tuple[Stack, Stack]) -> None:
    stack, keyed = stacks
    client = triton.InferenceServerClient(stack.url.removeprefix("http://"))
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    client.close()
    assert info.value.status() == "404"
    url = f"{stack.url}/v2/models/minilm/infer"
    bad = {
        "disagreeing shape": {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a"]}]},
        "negative dimension": {"inputs": [{"name": "text", "shape": [-1], "datatype": "BYTES", "data": ["a"]}]},
        "wrong datatype": {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
        "unknown input": {"inputs": [{"name": "txt", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
        "unknown parameter": {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
                              "parameters": {"nope": 1}},
    }
    for case, body in bad.items():
        response = httpx.post(url, json=body)
        assert response.status_code == 400, (case, response.text)
        assert isinstance(response.json()["error"], str) and response.json()["error"], case
    # Deadline: Triton's timeout parameter is in microseconds.
    timed = httpx.post(url, json={**bad["unknown input"], "inputs": [{"name": "text", "shape": [1],
                                  "datatype": "BYTES", "data": ["a"]}], "parameters": {"timeout": 1}})
    assert timed.status_code == 504 and timed.headers["x-should-retry"] == "false"
    # Queue full on the keyed gateway (bound 2, 200 ms a batch): 429 with Retry-After.
    body = {"inputs": [{"name": "input", "shape": [1], "datatype": "FP64", "data": [1.0]}]}
    with httpx.Client(base_url=keyed.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as keyed_client, \
            concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: keyed_client.post("/v2/models/synthetic/infer", json=body), range(12)))
    full = [r for r in responses if r.status_code == 429]
    assert full and all(r.headers["Retry-After"].isdigit() for r in full), [r.status_code for r in responses]
    assert httpx.post(f"{keyed.url}/v2/models/synthetic/infer", json=body).status_code == 401
    assert httpx.get(f"{keyed.url}/v2/health/live").status_code == 200  # probes stay open


def test_long_text_policy_on_every_route(stacks: tuple[Stack, Stack]) -> None:
    stack, _ = stacks
    long_text = "word " * 300
    native_too_long = httpx.post(f"{stack.url}/v1/models/minilm/infer", json={"inputs": [long_text]})
    assert native_too_long.status_code == 413 and native_too_long.json()["error"]["code"] == "input_too_long"
    cut = httpx.post(f"{stack.url}/v1/models/minilm/infer",
                     json={"inputs": [long_text], "parameters": {"truncate": True}})
    assert cut.status_code == 200
    v2 = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [long_text]}]}
    assert httpx.post(f"{stack.url}/v2/models/minilm/infer", json=v2).status_code == 413
    v2["parameters"] = {"truncate": True}
    v2_cut = httpx.post(f"{stack.url}/v2/models/minilm/infer", json=v2)
    assert v2_cut.status_code == 200
    np.testing.assert_allclose(v2_cut.json()["outputs"][0]["data"], cut.json()["outputs"][0], atol=1e-5)
    # Visible to the gateway, but no token for the model (a lone combining accent): refused by the worker.
    no_tokens = httpx.post(f"{stack.url}/v1/models/minilm/infer", json={"inputs": ["ok", "\u0301"]})
    assert no_tokens.status_code == 422 and "inputs[1]: no tokens" in no_tokens.text, no_tokens.text


def test_the_api_pages_client_examples_run_as_written(stacks: tuple[Stack, Stack]) -> None:
    """docs/reference/api/index.md, "The clients as they come": the openai and tritonclient snippet,
    pointed at this stack's port, prints what its comments say."""
    open_stack, _ = stacks
    page = (ROOT / "docs" / "reference" / "api" / "index.md").read_text()
    block = page.split("The clients as they come", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    host = open_stack.url.removeprefix("http://")
    done = subprocess.run([sys.executable, "-c", block.replace("127.0.0.1:8000", host)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["2 384", "(2, 384)"]
