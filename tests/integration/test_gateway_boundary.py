"""The gateway's edge through the real app and a real Redis: request limits, values the wire
cannot carry, the timeout header, the API key, Starlette's own 404/405 in our error format, and
the request id on every error of an inference request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
import pytest
import uvicorn

from tests.helpers import free_port, gateway_with, wait_until
from vramguard.shared.settings import Settings

JSON_TYPE = {"Content-Type": "application/json"}
INFER = "/v1/models/synthetic/infer"


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    return error  # type: ignore[no-any-return]


async def test_too_many_inputs_is_413_naming_both_numbers(settings_factory: Callable[..., Settings]) -> None:
    settings = settings_factory(models={"synthetic": {"max_inputs_per_request": 3}})
    async with gateway_with(settings) as gateway:
        error = error_of(await gateway.post(INFER, json={"inputs": [1, 2, 3, 4]}), 413, "payload_too_large")
        assert "4 inputs" in str(error["message"]) and "at most 3" in str(error["message"])
        # The default is 256 per request: 257 is refused before enqueueing (no worker needed to tell).
        error = error_of(await gateway.post("/v1/models/minilm/infer", json={"inputs": ["a"] * 257}),
                         413, "payload_too_large")
        assert "257" in str(error["message"]) and "256" in str(error["message"])


async def test_integers_the_wire_cannot_carry_are_422(gateway: httpx.AsyncClient) -> None:
    for body in ({"inputs": ["a"], "parameters": {"x": 123456789012345678901234567890}},
                 {"inputs": [18446744073709551616]}):
        error = error_of(await gateway.post(INFER, json=body), 422, "invalid_input")
        assert "outside the range" in str(error["message"])


async def test_openai_token_ids_the_wire_cannot_carry_are_400(gateway: httpx.AsyncClient) -> None:
    """A token id past 64 bits is refused naming the input, before it reaches msgpack's pack (where
    it raised: an unexpected error the app re-raised, a 500 and a closed connection over HTTP)."""
    wide = 1180591620717411303424  # 2**70
    for given, named in (([wide], "input:"), ([[1, 2], [wide]], "input[1]:")):
        response = await gateway.post("/v1/embeddings", json={"model": "minilm", "input": given})
        error = error_of(response, 400, "invalid_input")
        assert str(error["message"]).startswith(named) and "outside the range" in str(error["message"]), error
        assert "vocabulary" in str(error["message"]) and "string" not in str(error["message"]), error
        assert error["type"] == "invalid_request_error"


async def test_openai_embeddings_errors_say_what_is_wrong(gateway: httpx.AsyncClient) -> None:
    """`input` is a union (a string, strings, token ids, lists of token ids): the message is the
    member's that matches the value's own type, not "should be a valid string" for every fault."""
    for given, says in (([], "at least 1 item"), ([-1], "greater than or equal to 0"), ([[]], "at least 1 item")):
        response = await gateway.post("/v1/embeddings", json={"model": "minilm", "input": given})
        error = error_of(response, 400, "invalid_input")
        assert str(error["message"]).startswith("input: ") and says in str(error["message"]), (given, error)


async def test_openai_input_count_error_names_the_field_and_keeps_the_count_plural(gateway: httpx.AsyncClient) -> None:
    response = await gateway.post("/v1/embeddings", json={"model": "minilm", "input": ["a"] * 300})
    error = error_of(response, 413, "payload_too_large")
    assert str(error["message"]).startswith("300 inputs in one request;"), error


async def test_timeout_header_is_ascii_digits_and_checked_even_when_the_body_has_one(
    gateway: httpx.AsyncClient,
) -> None:
    cases = [
        ({"inputs": [1]}, {"X-Request-Timeout-Ms": "²"}),
        ({"inputs": [1]}, {"X-Request-Timeout-Ms": "１００"}),  # fullwidth digits
        ({"inputs": [1]}, {"X-Request-Timeout-Ms": "1" * 5000}),
        ({"inputs": [1], "timeout_ms": 500}, {"X-Request-Timeout-Ms": "soon"}),
        ({"inputs": [1], "timeout_ms": True}, {}),
        ({"inputs": [1], "timeout_ms": "100"}, {}),
        ({"inputs": [1], "timeout_ms": 100.0}, {}),
    ]
    for body, headers in cases:
        encoded = {k: v.encode() for k, v in headers.items()}  # httpx would refuse non-ASCII str values
        error_of(await gateway.post(INFER, json=body, headers=encoded), 422, "invalid_input")


async def test_api_key_guards_v1_routes_only(settings_factory: Callable[..., Settings]) -> None:
    async with gateway_with(settings_factory(api_key="k3y-s3cret")) as gateway:
        error_of(await gateway.get("/v1/models"), 401, "unauthorized")
        error_of(await gateway.post(INFER, json={"inputs": [1]}), 401, "unauthorized")
        wrong = await gateway.get("/v1/models", headers={"Authorization": "Bearer nope"})
        error_of(wrong, 401, "unauthorized")
        assert wrong.headers["WWW-Authenticate"] == "Bearer"
        error_of(await gateway.get("/v1/models", headers={"X-API-Key": "k3y-s3cre"}), 401, "unauthorized")
        error_of(await gateway.get("/v1/models", headers={"Authorization": "Basic k3y-s3cret"}), 401, "unauthorized")

        assert (await gateway.get("/v1/models", headers={"Authorization": "Bearer k3y-s3cret"})).status_code == 200
        assert (await gateway.get("/v1/models/synthetic", headers={"X-API-Key": "k3y-s3cret"})).status_code == 200
        # With the key, an inference request gets past the check (no worker here: 503, not 401).
        answered = await gateway.post(INFER, json={"inputs": [1]}, headers={"X-API-Key": "k3y-s3cret"})
        error_of(answered, 503, "unavailable")

        # Probes and scrapes stay open.
        assert (await gateway.get("/health/live")).status_code == 200
        assert (await gateway.get("/health/ready")).status_code == 503  # no worker, but not 401
        assert (await gateway.get("/metrics")).status_code == 200
        assert (await gateway.get("/status")).status_code == 200
        assert (await gateway.get("/status.json")).status_code == 200


async def test_unknown_route_and_wrong_method_use_the_error_format(gateway: httpx.AsyncClient) -> None:
    error = error_of(await gateway.get("/v3/nothing"), 404, "not_found")
    assert error["request_id"] is None
    wrong_method = await gateway.delete("/v1/models")
    error = error_of(wrong_method, 405, "method_not_allowed")
    assert error["request_id"] is None
    assert "GET" in wrong_method.headers["Allow"]
    # A wrong method on the native route answers in the native shape; an unknown /v1/ path in OpenAI's.
    native = error_of(await gateway.get(INFER), 405, "method_not_allowed")
    assert set(native) == {"code", "message", "request_id"}, native
    assert error_of(await gateway.get("/v1/embeddings"), 405, "method_not_allowed")["type"] == "invalid_request_error"
    assert error_of(await gateway.get("/v1/responses"), 404, "not_found")["type"] == "invalid_request_error"


async def test_head_on_health_for_load_balancers(gateway: httpx.AsyncClient) -> None:
    assert (await gateway.head("/health/live")).status_code == 200
    assert (await gateway.head("/health/ready")).status_code == 503  # no worker yet


async def test_every_error_of_an_inference_request_carries_its_request_id(
    settings_factory: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vramguard.gateway.observe.metrics")
    settings = settings_factory(models={"synthetic": {"max_inputs_per_request": 2}}, max_body_bytes=1024)
    async with gateway_with(settings) as gateway:
        cases = [
            (await gateway.post("/v1/models/nope/infer", json={"inputs": [1]}), 404, "model_not_found"),
            (await gateway.post(INFER, content=b"{oops", headers=JSON_TYPE), 400, "invalid_input"),
            (await gateway.post(INFER, json={"inputs": []}), 422, "invalid_input"),
            (await gateway.post(INFER, json={"inputs": [1]}, headers={"X-Request-Timeout-Ms": "0"}),
             422, "invalid_input"),
            (await gateway.post(INFER, json={"inputs": [1, 2, 3]}), 413, "payload_too_large"),
            (await gateway.post(INFER, json={"inputs": ["a" * 2000]}), 413, "payload_too_large"),
            (await gateway.post(INFER, json={"inputs": [1]}), 503, "unavailable"),  # from the Dispatcher
        ]
        ids = [error_of(response, status, code)["request_id"] for response, status, code in cases]
        assert all(isinstance(i, str) and len(i) == 32 for i in ids), ids
        # A client's model name is echoed cut, as every echo of its input is.
        long_name = error_of(await gateway.post(f"/v1/models/{'m' * 5000}/infer", json={"inputs": [1]}),
                             404, "model_not_found")
        assert len(long_name["message"]) < 300
        assert len(set(ids)) == len(ids)
        # The Dispatcher used the id the route assigned: the 503 it raised and the route's log line agree.
        logged = [getattr(r, "request_id", None) for r in caplog.records if r.getMessage() == "request done"]
        assert ids[-1] in logged


async def test_a_401_and_the_openai_errors_before_the_body_carry_a_request_id(
    settings_factory: Callable[..., Settings],
) -> None:
    """The id is assigned on arrival, ahead of the API key and of the body that names the model."""
    settings = settings_factory(api_key="k3y-s3cret", max_body_bytes=1024)
    key = {"X-API-Key": "k3y-s3cret"}
    embeddings = "/v1/embeddings"
    async with gateway_with(settings) as gateway:
        ids = [
            error_of(await gateway.post(INFER, json={"inputs": [1]}), 401, "unauthorized")["request_id"],
            (await gateway.post(embeddings, json={"model": "minilm", "input": "a"})).json()["error"]["request_id"],
        ]
        pre_body = [
            (await gateway.post(embeddings, content=b"a", headers={**key, "Content-Type": "text/plain"}), 415),
            (await gateway.post(embeddings, content=b"{oops", headers={**key, **JSON_TYPE}), 400),
            (await gateway.post(embeddings, content=b"x" * 2048, headers={**key, **JSON_TYPE}), 413),
            (await gateway.post(embeddings, json={"model": "minilm", "input": "a"},
                                headers={**key, "X-Request-Timeout-Ms": "soon"}), 400),  # OpenAI's 400
        ]
        for response, status in pre_body:
            assert response.status_code == status, response.text
            ids.append(response.json()["error"]["request_id"])
    assert all(isinstance(i, str) and len(i) == 32 for i in ids), ids
    assert len(set(ids)) == len(ids)


async def test_an_unexpected_error_is_a_500_that_says_it_closes_the_connection(
    settings_factory: Callable[..., Settings],
) -> None:
    """A bug in a route (one added here that raises) over real HTTP (uvicorn with the gateway's
    protocol): a 500 `internal` with `Connection: close`, since the connection is closed after it;
    the request pipelined behind it is not answered on that connection, and was told so."""
    from vramguard.gateway.app import create_app
    from vramguard.gateway.edge.server import uvicorn_options

    settings = settings_factory()
    app = create_app(settings)

    async def bug() -> None:
        raise RuntimeError("a bug in a route")

    app.add_api_route("/bug", bug)
    port = free_port()
    options = {k: v for k, v in uvicorn_options(settings).items() if k != "loop"}  # runs on this test's loop
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, **options))
    serving = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started, 30)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /bug HTTP/1.1\r\nHost: x\r\n\r\nGET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)  # all of it, until the server closes
        writer.close()
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 500") and b"\r\nconnection: close" in head, answer[:500]
        assert b'"code":"internal"' in answer and answer.count(b"HTTP/1.1 ") == 1, answer[:500]
    finally:
        server.should_exit = True
        await serving
