"""The strict HTTP edge through the real app: media types, compressed bodies, declared
parameters, no redirects, the gateway's half of the input-length policy, error bodies without
internal details, and the API key refused at start when blank."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import subprocess
import sys
import zlib
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.helpers import ROOT, RedisServer, free_port, gateway_with, service_env, synthetic_lm_models, wait_until
from vramguard.shared.models import CATALOGUE
from vramguard.shared.settings import Settings

INFER = "/v1/models/synthetic/infer"
JSON = {"Content-Type": "application/json"}


def code_of(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


async def test_inference_needs_a_json_content_type(gateway: httpx.AsyncClient) -> None:
    body = b'{"inputs": [1]}'
    for headers in ({"Content-Type": "text/plain"}, {}, {"Content-Type": "application/x-www-form-urlencoded"}):
        for path in (INFER, "/v1/embeddings"):
            response = await gateway.post(path, content=body, headers=headers)
            assert response.status_code == 415, (path, headers, response.text)
    ok_type = await gateway.post(INFER, content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert ok_type.status_code == 503  # past the edge: no worker in this test
    # The v2 route takes none (tritonclient sends none), JSON or octet-stream, and nothing else.
    v2 = b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP64", "data": [1.0]}]}'
    assert (await gateway.post("/v2/models/synthetic/infer", content=v2)).status_code == 503
    refused = await gateway.post("/v2/models/synthetic/infer", content=v2, headers={"Content-Type": "text/plain"})
    assert refused.status_code == 415 and isinstance(refused.json()["error"], str)


async def test_gzip_and_deflate_bodies_are_read_with_a_cap(settings_factory: Callable[..., Settings]) -> None:
    async with gateway_with(settings_factory(max_body_bytes=4096)) as gateway:
        body = b'{"inputs": [1], "parameters": {"bogus": 1}}'  # 422 proves the body was read
        for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
            response = await gateway.post(INFER, content=packed, headers={**JSON, "Content-Encoding": encoding})
            assert response.status_code == 422 and "bogus" in response.text, response.text
        bomb = gzip.compress(b'{"inputs": ["' + b"a" * 1_000_000 + b'"]}')  # ~1 KiB that inflates to 1 MB
        assert len(bomb) < 4096
        response = await gateway.post(INFER, content=bomb, headers={**JSON, "Content-Encoding": "gzip"})
        assert response.status_code == 413 and "decompressed" in response.text
        broken = await gateway.post(INFER, content=b"not gzip", headers={**JSON, "Content-Encoding": "gzip"})
        assert broken.status_code == 400
        other = await gateway.post(INFER, content=body, headers={**JSON, "Content-Encoding": "br"})
        assert other.status_code == 415 and "'br'" in other.text
        # Bytes after the stream's end (junk, a second member) are not silently dropped.
        for trailing in (b"junk", gzip.compress(b"[]")):
            response = await gateway.post(INFER, content=gzip.compress(body) + trailing,
                                          headers={**JSON, "Content-Encoding": "gzip"})
            assert response.status_code == 400 and "follow the end" in response.text, response.text


async def test_two_content_types_are_400_on_every_route(gateway: httpx.AsyncClient) -> None:
    """Content-Type is a singleton field: two of them (the first JSON, the second not) are refused,
    not read by the first."""
    two = [("Content-Type", "application/json"), ("Content-Type", "text/plain")]
    for path, body in ((INFER, {"inputs": [1]}), ("/v1/embeddings", {"model": "minilm", "input": "a"}),
                       ("/v2/models/synthetic/infer",
                        {"inputs": [{"name": "input", "shape": [1], "datatype": "FP64", "data": [1]}]})):
        response = await gateway.post(path, content=json.dumps(body).encode(), headers=two)
        assert response.status_code == 400 and "2 Content-Type headers" in response.text, (path, response.text)


async def test_a_path_ending_in_a_newline_is_404(gateway: httpx.AsyncClient) -> None:
    """Starlette's `$` also matches before a final newline: /health/live%0A must not be /health/live."""
    for method, path in (("GET", "/health/live%0A"), ("HEAD", "/health/live%0A"), ("GET", "/v1/models%0A"),
                         ("POST", INFER + "%0A")):
        response = await gateway.request(method, path, json={"inputs": [1]} if method == "POST" else None)
        assert response.status_code == 404, (method, path, response.status_code)
    assert (await gateway.get("/health/live")).status_code == 200


async def test_parameters_are_the_models_declared_ones(gateway: httpx.AsyncClient) -> None:
    unknown = await gateway.post("/v1/models/minilm/infer", json={"inputs": ["a"], "parameters": {"truncat": True}})
    assert unknown.status_code == 422 and "parameters.truncat" in unknown.text and "truncate" in unknown.text
    wrong_type = await gateway.post("/v1/models/minilm/infer", json={"inputs": ["a"], "parameters": {"truncate": 1}})
    assert wrong_type.status_code == 422 and "boolean" in wrong_type.text
    declared = await gateway.post("/v1/models/minilm/infer", json={"inputs": ["a"], "parameters": {"truncate": True}})
    assert declared.status_code == 503  # past the checks
    v2_text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"], "parameters": None}
    for path, body in (("/v1/models/minilm/infer", {"inputs": ["a"], "parameters": None, "timeout_ms": None}),
                       ("/v2/models/minilm/infer", {"inputs": [v2_text], "parameters": None,
                                                    "outputs": [{"name": "embedding", "parameters": None}]})):
        none_given = await gateway.post(path, json=body)  # null reads as absent, as for timeout_ms
        assert none_given.status_code == 503, (path, none_given.text)
    for value in ("yes", 1):  # the OpenAI route's truncate is as strict as the native one
        wrong = await gateway.post("/v1/embeddings", json={"model": "minilm", "input": "a", "truncate": value})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "truncate", wrong.text


async def test_trailing_slash_is_404_in_the_error_format_not_a_redirect(gateway: httpx.AsyncClient) -> None:
    for method, path in (("POST", "/v1/models/minilm/infer/"), ("GET", "/health/ready/"), ("GET", "/v1/models/"),
                         ("POST", "/v1/embeddings/")):
        response = await gateway.request(method, path, json={})
        assert response.status_code == 404 and code_of(response) == "not_found", (path, response.status_code)
    response = await gateway.get("/v2/models/minilm/")
    assert response.status_code == 404 and isinstance(response.json()["error"], str)


async def test_text_length_policy_at_the_gateway(gateway: httpx.AsyncClient) -> None:
    """Refused before any worker (none runs here): invisible-only text, and text longer than the
    window can span, unless truncation is asked for (then it is cut and goes on: 503 here)."""
    for text in ("\u200b\u200b", "\x00\x01", " \u2028\t"):
        response = await gateway.post("/v1/models/minilm/infer", json={"inputs": ["ok", text]})
        assert response.status_code == 422 and "inputs[1]" in response.text, text
    limit = CATALOGUE["minilm"].max_input_chars
    assert limit is not None
    long_texts = ["a " * limit] * 3  # 3 x 2 x limit characters: would be seconds of tokenizing
    response = await gateway.post("/v1/models/minilm/infer", json={"inputs": long_texts})
    assert response.status_code == 413 and code_of(response) == "input_too_long"
    assert str(2 * limit) in response.text and "256-token" in response.text
    assert "set parameters.truncate=true" in response.json()["error"]["message"]  # how to opt in, natively
    cut = await gateway.post("/v1/models/minilm/infer", json={"inputs": long_texts, "parameters": {"truncate": True}})
    assert cut.status_code == 503
    ids = await gateway.post("/v1/embeddings", json={"model": "minilm", "input": list(range(300))})
    assert ids.status_code == 413 and ids.json()["error"]["code"] == "input_too_long"
    assert 'set "truncate": true in the body' in ids.json()["error"]["message"]  # in the OpenAI body's terms


async def test_error_bodies_carry_no_redis_address(
    settings_factory: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vramguard.gateway.observe.metrics")
    server = RedisServer()
    server.start()
    port = server.port
    async with gateway_with(settings_factory(redis_url=server.url)) as gateway:
        server.stop()

        async def redis_seen_down() -> bool:
            return "redis" in (await gateway.get("/health/ready")).text

        await wait_until(redis_seen_down, 10)
        for path, body in ((INFER, {"inputs": [1]}), ("/v1/embeddings", {"model": "minilm", "input": "a"})):
            response = await gateway.post(path, json=body)
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert "127.0.0.1" not in response.text and str(port) not in response.text, response.text
            # The log line of the same request id has what the client was not told.
            request_id = response.json()["error"]["request_id"]
            (line,) = [r for r in caplog.records if getattr(r, "request_id", None) == request_id]
            assert str(port) in line.error_detail  # type: ignore[attr-defined]


@pytest.mark.parametrize("key", ["", "   "])
def test_blank_api_key_stops_the_gateway_at_start(key: str) -> None:
    env = service_env("redis://127.0.0.1:1/0", port=free_port(), api_key=key)
    argv = [sys.executable, "-m", "vramguard.gateway"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"VRAMGUARD_API_KEY" in done.stderr and b"empty" in done.stderr


async def test_openapi_describes_bodies_and_errors(gateway: httpx.AsyncClient) -> None:
    schema = (await gateway.get("/openapi.json")).json()
    for path in ("/v1/models/{model}/infer", "/v1/embeddings", "/v2/models/{model}/infer"):
        post = schema["paths"][path]["post"]
        assert "requestBody" in post, path
        assert {"413", "415", "429", "503", "504"} <= set(post["responses"]), path
    assert {"InferRequest", "EmbeddingsRequest", "V2InferRequest"} <= set(schema["components"]["schemas"])
    # v2 answers 400 to every invalid request (as Triton does): the schema must not promise a 422.
    v2_statuses = {status for path, operations in schema["paths"].items() if path.startswith("/v2")
                   for operation in operations.values() for status in operation["responses"]}
    assert "400" in v2_statuses and "422" not in v2_statuses
    # So do the OpenAI routes, as OpenAI's API does.
    for path in ("/v1/embeddings", "/v1/chat/completions", "/v1/completions"):
        assert "422" not in schema["paths"][path]["post"]["responses"], path
    assert "400" in schema["paths"]["/v1/embeddings"]["post"]["responses"]
    # A route that takes only its path's model name cannot be sent an invalid request: no 422 there,
    # while the native infer route, whose body can be invalid, keeps its.
    for path in ("/v1/models/{model}", "/v1/models/{model}/ready"):
        assert "422" not in schema["paths"][path]["get"]["responses"], path
    assert "422" in schema["paths"]["/v1/models/{model}/infer"]["post"]["responses"]


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
CHAT_BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
TEXT_BODY = {"model": "smollm2", "prompt": "hi"}
# (route, what the body changes, the error's `param`, words its message holds)
REFUSED_GENERATIONS: list[tuple[str, dict[str, object], str, str]] = [
    (CHAT, {"logprobs": True}, "logprobs", "not supported"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    (TEXT, {"frequency_penalty": -1}, "frequency_penalty", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages.0.content", "'image_url' is not supported"),
    (CHAT, {"messages": [{"role": "user", "content": ["a", "b"]}]}, "messages.0.content",
     'a text part is {"type": "text", "text": "<string>"}'),
    (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings"),
    (CHAT, {"stop": ""}, "stop", "at least 1 character"),
    (CHAT, {"stop": ["a", ""]}, "stop.1", "at least 1 character"),
    (TEXT, {"prompt": ""}, "prompt", "at least 1 character"),
    (TEXT, {"prompt": 5}, "prompt", "valid string"),
    (TEXT, {"prompt": ["a", "b"]}, "prompt", "several prompts are not"),
    (TEXT, {"prompt": [1, 2, 3]}, "prompt", "token-id prompts"),
    (CHAT, {"messages": None}, "messages", "valid list"),
    (CHAT, {"logprobs": True, "tools": [{}]}, "logprobs", "(only false or null is accepted); nor are tools"),
    (CHAT, {"temperature": True}, "temperature", "valid number"),
    (TEXT, {"top_p": "0.5"}, "top_p", "valid number"),
    (CHAT, {"n": True}, "n", "only n = 1"),
    (CHAT, {"n": "1"}, "n", "the integer 1, not a string"),
]
# Bodies without a field they need: the error names that field, not the body.
MISSING_FIELDS = [(CHAT, "messages"), (CHAT, "model"), (TEXT, "prompt"), (TEXT, "model")]


async def test_generation_bodies_are_refused_naming_the_bodys_own_field(
        settings_factory: Callable[..., Settings]) -> None:
    """No worker runs here, so a body past every check is 503. OpenAI's neutral values (logprobs
    false, penalties 0, role developer, text content parts) pass; anything else is 400 in OpenAI's
    shape whose `param` and message name the body's own field, not a pydantic type name."""
    async with gateway_with(settings_factory(served_models="smollm2")) as gateway:
        for path, change, param, words in REFUSED_GENERATIONS:
            response = await gateway.post(path, json={**(CHAT_BODY if path == CHAT else TEXT_BODY), **change})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == param, (change.keys(), response.text[:300])
            assert error["message"].startswith(f"{param}: ") and words in error["message"], error["message"]
        # A prompt whose characters alone cannot fit the window: OpenAI's context_length_exceeded.
        for path, change, param in ((TEXT, {"prompt": "x" * 2_000_000}, "prompt"),
                                    (CHAT, {"messages": [{"role": "user", "content": "x" * 2_000_000}]}, "messages")):
            response = await gateway.post(path, json={**(CHAT_BODY if path == CHAT else TEXT_BODY), **change})
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == "context_length_exceeded", response.text[:300]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
            assert error["message"].startswith("This model's maximum context length is 2048 tokens.") \
                and "2000000 characters" in error["message"], error["message"]
        for path, field in MISSING_FIELDS:
            body = {k: v for k, v in (CHAT_BODY if path == CHAT else TEXT_BODY).items() if k != field}
            error = (await gateway.post(path, json=body)).json()["error"]
            assert error["param"] == field and error["message"] == f"{field}: Field required", error
        # OpenAI's other parameters at null, their default, ask for nothing either.
        neutral = {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "tools": None,
                   "top_logprobs": None, "response_format": None, "n": None, "temperature": None, "top_p": None,
                   "stream": None, "stream_options": None, "max_tokens": None}
        # Thousands of unknown keys: the refusal names a few, not all of them back.
        many = await gateway.post(CHAT, json={**CHAT_BODY, **{f"k{i:05}" + "x" * 60: 1 for i in range(5000)}})
        assert many.status_code == 400 and len(many.text) < 2000 and "and 4994 more" in many.text, many.text[:300]
        parts = [{"role": "developer", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
        for path, body in ((CHAT, {**CHAT_BODY, **neutral}), (CHAT, {**CHAT_BODY, "messages": parts}),
                           (TEXT, {**TEXT_BODY, **neutral})):
            response = await gateway.post(path, json=body)
            assert response.status_code == 503, response.text  # past every check: no worker here
        # The v2 route, which a generative model does not serve, points at the routes that do.
        v2 = await gateway.post("/v2/models/smollm2/infer", json={"inputs": []})
        assert v2.status_code == 400 and "use POST /v1/chat/completions or POST /v1/completions" in v2.text, v2.text


async def test_v1_not_found_and_unparseable_bodies_are_openai_shaped(gateway: httpx.AsyncClient) -> None:
    for method, path in (("GET", "/v1/nope"), ("POST", "/v1/responses"), ("POST", "/v1/chat/completions/")):
        response = await gateway.request(method, path, json={})
        error = response.json()["error"]
        assert response.status_code == 404 and error["code"] == "not_found", (path, response.text)
        assert error["type"] == "invalid_request_error" and error["param"] is None and path in error["message"]
    # A lone surrogate no tokenizer encodes; nesting deeper than any parser recurses (was 500).
    lone = b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}]}'
    for path, body in [(p, b"{not json") for p in (CHAT, TEXT, "/v1/embeddings")] + [
            (CHAT, lone), (TEXT, b'{"model": "smollm2", "prompt": "\\udfff"}'), (CHAT, b"[" * 50_000),
            (TEXT, b'{"model": "smollm2", "prompt": "hi", "temperature": NaN}')]:  # NaN is not JSON
        response = await gateway.post(path, content=body, headers=JSON)
        error = response.json()["error"]
        assert response.status_code == 400 and error["type"] == "invalid_request_error", (path, response.text)
        assert error["param"] is None and "JSON" in error["message"] and error["code"] == "invalid_input"
        if b"\\ud" in body:  # the parser's "unexpected end of hex escape" alone does not say what is wrong
            assert "surrogate pair" in error["message"], error["message"]


async def test_stream_options_without_stream_is_openai_400(settings_factory, start_worker, tmp_path) -> None:
    """The real `openai` client against an in-process gateway and synthetic-LM worker: `stream_options`
    without `stream: true` (false, or left out) is 400 invalid_request_error with param stream_options
    and OpenAI's message, on both routes; with `stream: true` it still streams the usage chunk."""
    settings = settings_factory(models_file=str(synthetic_lm_models(tmp_path, window=64)), served_models="simlm")
    await start_worker(model="simlm", models_file=settings.models_file, served_models="simlm")
    async with gateway_with(settings) as http:
        await wait_until(lambda: _ready(http), 60)
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
        chat = {"model": "simlm", "messages": [{"role": "user", "content": "a bb"}], "max_tokens": 2}
        text = {"model": "simlm", "prompt": "a bb", "max_tokens": 2}
        usage = {"include_usage": True}
        for create, body, stream in itertools.product(
                (client.chat.completions.create, client.completions.create), ({}, {"stream": False}), (usage, {})):
            kw = chat if create == client.chat.completions.create else text
            with pytest.raises(openai.BadRequestError) as caught:
                await create(**kw, **body, stream_options=stream)  # type: ignore[call-overload]
            error = caught.value
            assert error.code == "invalid_input" and error.param == "stream_options", error.body
            assert error.type == "invalid_request_error", error.body
            assert "The 'stream_options' parameter is only allowed when 'stream' is enabled." in error.message
        for create, kw in ((client.chat.completions.create, chat), (client.completions.create, text)):
            chunks = [chunk async for chunk in await create(**kw, stream=True, stream_options=usage)]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2, chunks[-1]


async def _ready(http: httpx.AsyncClient) -> bool:
    return (await http.get("/health/ready")).status_code == 200


async def test_nan_and_infinity_are_named_as_json_has_no_such_constant(gateway: httpx.AsyncClient) -> None:
    """A body that is, or holds, NaN or (-)Infinity is UTF-8: the OpenAI routes' 400 names the
    constant as what JSON lacks, at the parser's line and column, instead of "not UTF-8 JSON"."""
    bodies = (b"NaN", b"Infinity", b"-Infinity", b'{"model": "smollm2", "prompt": "hi", "temperature": NaN}')
    for path, body in [(path, body) for path in (CHAT, TEXT) for body in bodies]:
        response = await gateway.post(path, content=body, headers=JSON)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "invalid_input", (path, body, response.text)
        assert error["message"].startswith("body is not valid JSON: NaN and Infinity are not JSON numbers"), error
        assert "line 1 column" in error["message"] and "UTF-8" not in error["message"], error
    # The native and v2 routes read NaN as a number and refuse it where it stands, not as encoding.
    v2 = b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP64", "data": [NaN]}]}'
    for path, body in ((INFER, b"NaN"), (INFER, b'{"inputs": [NaN]}'), ("/v2/models/synthetic/infer", b"Infinity"),
                       ("/v2/models/synthetic/infer", v2)):
        response = await gateway.post(path, content=body, headers=JSON)
        error = response.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert response.status_code in (400, 422) and "UTF-8" not in message, (path, response.text)
        assert "object" in message or "finite" in message, (path, message)


async def test_a_lone_surrogate_is_named_on_the_native_and_v2_routes(gateway: httpx.AsyncClient) -> None:
    """A UTF-16 surrogate escape that is not half of a pair: 400 saying so (with the parser's line and
    column), not only the parser's "unexpected end of hex escape" behind "Invalid JSON: "."""
    v2 = b'{"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}'
    for path, body in ((INFER, b'{"inputs": ["\\ud800"]}'), ("/v2/models/synthetic/infer", v2)):
        response = await gateway.post(path, content=body, headers=JSON)
        error = response.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert response.status_code == 400, (path, response.text)
        assert message.startswith("body is not valid JSON: unexpected end of hex escape at line 1"), message
        assert "surrogate pair" in message and "Invalid JSON" not in message, message
