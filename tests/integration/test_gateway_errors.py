"""Every error a client can get through the real gateway app and a real Redis: status and code."""

from __future__ import annotations

import httpx

from tests.helpers import wait_until

JSON_TYPE = {"Content-Type": "application/json"}


async def ready(gateway: httpx.AsyncClient) -> None:
    async def check() -> bool:
        return (await gateway.get("/health/ready")).status_code == 200

    await wait_until(check, 10)


async def test_readiness_is_503_until_a_model_has_a_worker_and_names_what_each_model_lacks(
    gateway, start_worker
) -> None:
    response = await gateway.get("/health/ready")
    assert response.status_code == 503
    assert response.json()["reasons"] == ["no served model has a live worker"]
    assert response.json()["models"]["synthetic"]["reasons"] == ["no live worker"]
    assert (await gateway.get("/health/live")).status_code == 200
    await start_worker(model="synthetic")
    await ready(gateway)  # synthetic can be served: so can this gateway, though minilm cannot
    models = (await gateway.get("/health/ready")).json()["models"]
    assert models["synthetic"]["ready"] and models["minilm"]["reasons"] == ["no live worker"]


async def test_no_worker_is_503_unavailable(gateway) -> None:
    response = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [1]})
    assert response.status_code == 503
    body = response.json()["error"]
    assert body["code"] == "unavailable" and body["request_id"]


async def test_round_trip_and_errors(gateway, start_worker) -> None:
    await start_worker(model="synthetic")

    async def has_worker() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(has_worker, 10)
    ok = await gateway.post("/v1/models/synthetic/infer", json={"inputs": [1, "two", [3.5], {"k": None}]})
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"] == [1, "two", [3.5], {"k": None}]

    cases = [
        (await gateway.post("/v1/models/nope/infer", json={"inputs": [1]}), 404, "model_not_found"),
        (await gateway.post("/v1/models/synthetic/infer", json={"inputs": []}), 422, "invalid_input"),
        (await gateway.post("/v1/models/synthetic/infer", json={"input": [1]}), 422, "invalid_input"),
        (await gateway.post("/v1/models/minilm/infer", json={"inputs": [42]}), 422, "invalid_input"),
        (await gateway.post("/v1/models/minilm/infer", json={"inputs": [""]}), 422, "invalid_input"),
        (await gateway.post("/v1/models/synthetic/infer", content=b"{oops", headers=JSON_TYPE), 400, "invalid_input"),
        (await gateway.post("/v1/models/synthetic/infer", content=b'{"inputs": [NaN]}', headers=JSON_TYPE),
         422, "invalid_input"),
        (await gateway.post("/v1/models/synthetic/infer", json={"inputs": [1]}, headers={"X-Request-Timeout-Ms": "x"}),
         422, "invalid_input"),
        (await gateway.post("/v1/models/synthetic/infer", content=b'{"inputs": ["' + b"a" * 9_000_000 + b'"]}',
                            headers=JSON_TYPE),
         413, "payload_too_large"),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        assert response.json()["error"]["message"]


async def test_deadline_passes_while_the_worker_is_busy_is_504(gateway, start_worker) -> None:
    # A forward of 1.5 s: a request with a 300 ms budget cannot be answered in time.
    await start_worker(model="synthetic", models={"synthetic": {"params": {"batch_ms": 1500}}})
    await ready_model(gateway, "synthetic")
    slow = gateway.post("/v1/models/synthetic/infer", json={"inputs": [1]})
    timed = gateway.post("/v1/models/synthetic/infer", json={"inputs": [2]}, headers={"X-Request-Timeout-Ms": "300"})
    import asyncio

    first, second = await asyncio.gather(slow, timed)
    assert first.status_code == 200
    assert second.status_code == 504 and second.json()["error"]["code"] == "deadline_exceeded"
    assert second.json()["error"]["request_id"]


async def ready_model(gateway: httpx.AsyncClient, model: str) -> None:
    async def check() -> bool:
        return (await gateway.get(f"/v1/models/{model}")).json()["live_workers"] >= 1

    await wait_until(check, 10)


async def test_model_listing_shows_batching_settings(gateway) -> None:
    listing = (await gateway.get("/v1/models")).json()["models"]
    by_name = {m["name"]: m for m in listing}
    assert set(by_name) == {"minilm", "synthetic"}
    assert by_name["minilm"]["config"]["max_batch_size"] == 32
    assert by_name["minilm"]["config"]["max_wait_ms"] == 5.0
    # What a client may send: the declared parameters (others are 422) and a sample `inputs` list.
    assert by_name["minilm"]["parameters"]["truncate"]["type"] == "boolean"
    assert by_name["minilm"]["example"] == ["a sentence", "another one"]
    assert (await gateway.get("/v1/models/nope")).status_code == 404


async def test_gateway_starts_without_redis_and_answers_503(settings_factory) -> None:
    """1. The gateway starts while nothing listens at its Redis URL.
    Result: it starts (liveness 200), readiness and inference answer 503 `unavailable`, and no
    Redis address reaches the client."""
    from tests.helpers import free_port, gateway_with

    async with gateway_with(settings_factory(redis_url=f"redis://127.0.0.1:{free_port()}/0")) as client:
        assert (await client.get("/health/live")).status_code == 200
        assert (await client.get("/health/ready")).status_code == 503
        refused = await client.post("/v1/models/synthetic/infer", json={"inputs": [1]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        assert "127.0.0.1" not in refused.text
