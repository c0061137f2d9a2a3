"""`GET /metrics` after known traffic, parsed with prometheus_client's own text parser: the
gateway's request series, the queues, the worker series carried by heartbeats, and the memory
fields of the heartbeat schema, which disappear with the heartbeat that carried them."""

from __future__ import annotations

import asyncio
import time

import httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import REQUESTS_FIELD, pack_requests

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> tuple[Samples, dict[str, str]]:
    """(value by (sample name, labels), type by family name) of one /metrics scrape."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def matching(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    want = set(labels.items())
    return {lbl: v for (n, lbl), v in samples.items() if n == name and want <= lbl}


async def test_metrics_after_known_traffic(gateway, start_worker, redis_client: aioredis.Redis, key_prefix) -> None:
    """1. A synthetic worker serves 6 good requests (8 items), 1 failing and 1 invalid one;
    one undecodable entry goes to the dead letter; one request names an unknown model.
    Result: every series says exactly that."""
    await start_worker(model="synthetic", fault_injection=True, worker_name="w-known")
    started_s = time.time()

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    for i in range(5):
        assert (await gateway.post("/v1/models/synthetic/infer", json={"inputs": [i]})).status_code == 200
    assert (await gateway.post("/v1/models/synthetic/infer", json={"inputs": [1, 2, 3]})).status_code == 200
    assert (await gateway.post("/v1/models/synthetic/infer", json={"inputs": [{"fault": "raise"}]})).status_code == 500
    assert (await gateway.post("/v1/models/synthetic/infer", json={"inputs": []})).status_code == 422
    assert (await gateway.post("/v1/models/nope/infer", json={"inputs": [1]})).status_code == 404
    await redis_client.xadd(Keys(key_prefix).request_stream("synthetic"), {b"m": b"not msgpack"})

    worker = {"model": "synthetic", "worker": "w-known", "device": "cpu", "gpu": ""}  # not pinned to a GPU

    async def settled() -> bool:
        samples, _ = await scrape(gateway)
        return (value(samples, "vramguard_worker_items_total", **worker) == 9
                and value(samples, "vramguard_dead_letter_entries", model="synthetic") == 1)

    await wait_until(settled, 10)
    samples, types = await scrape(gateway)

    # Gateway side: by model and outcome; the unknown model is not a label value.
    assert value(samples, "vramguard_requests_total", model="synthetic", outcome="ok") == 6
    assert value(samples, "vramguard_requests_total", model="synthetic", outcome="model_error") == 1
    assert value(samples, "vramguard_requests_total", model="synthetic", outcome="invalid_input") == 1
    assert not matching(samples, "vramguard_requests_total", model="nope")
    assert value(samples, "vramguard_request_duration_seconds_count", model="synthetic", outcome="ok") == 6
    assert value(samples, "vramguard_request_duration_seconds_sum", model="synthetic", outcome="ok") > 0
    assert value(samples, "vramguard_requests_in_flight", model="synthetic") == 0
    assert types["vramguard_requests"] == "counter" and types["vramguard_request_duration_seconds"] == "histogram"

    # Queues, read at scrape time.
    assert value(samples, "vramguard_queue_depth", model="synthetic") == 0
    assert value(samples, "vramguard_pending_entries", model="synthetic") == 0
    assert value(samples, "vramguard_dead_letter_entries", model="synthetic") == 1
    assert value(samples, "vramguard_redis_up") == 1
    assert value(samples, "vramguard_live_workers", model="synthetic") == 1
    assert value(samples, "vramguard_live_workers", model="minilm") == 0

    # Worker side, carried by the heartbeat: 7 requests with items, 9 items in 7 batches.
    assert value(samples, "vramguard_worker_requests_total", **worker) == 7
    assert value(samples, "vramguard_worker_healthy", **worker) == 1
    assert value(samples, "vramguard_batch_size_count", **worker) == 7
    assert value(samples, "vramguard_batch_size_sum", **worker) == 9
    assert value(samples, "vramguard_batch_size_bucket", **worker, le="1.0") == 6
    assert value(samples, "vramguard_batch_size_bucket", **worker, le="+Inf") == 7
    assert value(samples, "vramguard_queue_delay_seconds_count", **worker) == 7
    assert value(samples, "vramguard_forward_duration_seconds_count", **worker) == 7
    assert types["vramguard_batch_size"] == types["vramguard_queue_delay_seconds"] == "histogram"
    assert value(samples, "vramguard_worker_items_per_second", **worker) >= 0
    assert abs(value(samples, "vramguard_worker_start_time_seconds", **worker) - started_s) < 120
    info = matching(samples, "vramguard_worker_info", **worker)
    assert [dict(lbl)["state"] for lbl in info] == ["ready"]
    # A CPU worker reports its memory from its own accounting (RSS), labelled device="cpu".
    for name in ("allocated", "reserved", "peak", "total", "budget"):
        assert value(samples, f"vramguard_worker_memory_{name}_bytes", **worker) > 0, name
    assert value(samples, "vramguard_worker_memory_total_bytes", **worker) >= value(
        samples, "vramguard_worker_memory_allocated_bytes", **worker)
    assert value(samples, "vramguard_worker_oom_events_total", **worker) == 0


async def test_refused_requests_are_counted_under_their_code_and_unserved_models_under_one_label(gateway) -> None:
    """1. Requests naming a model this gateway does not serve (404) on the native, v2, chat and
       embeddings routes, each under its own made-up name.
    2. Invalid bodies: on the native and v2 routes of a served model; on the OpenAI routes, bodies that
       do not parse, fail validation, or ask for stream_options without stream.
    Result: each is in vramguard_requests_total and the duration histogram under the error body's code;
    an unserved model, or an OpenAI body refused before it names a served one, under model="", never
    the client's string."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    refused = [
        ("/v1/models/nope-1/infer", {"inputs": [1]}, 404), ("/v2/models/nope-2/infer", {"inputs": []}, 404),
        ("/v1/chat/completions", {"model": "nope-3", **chat}, 404),
        ("/v1/embeddings", {"model": "nope-4", "input": "x"}, 404),
        ("/v1/models/synthetic/infer", {"inputs": []}, 422), ("/v2/models/synthetic/infer", {"inputs": []}, 400),
        ("/v1/chat/completions", b"{oops", 400), ("/v1/completions", {"model": "smollm2", "prompt": ""}, 400),
        ("/v1/chat/completions", {"model": "smollm2", **chat, "stream_options": {"include_usage": True}}, 400),
        ("/v1/embeddings", {"model": "minilm", "input": 5}, 400),
    ]
    for path, body, status in refused:
        sent = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {
            "json": body}
        response = await gateway.post(path, **sent)
        assert response.status_code == status, (path, response.text)
    samples, _ = await scrape(gateway)

    assert value(samples, "vramguard_requests_total", model="", outcome="model_not_found") == 4
    assert value(samples, "vramguard_requests_total", model="", outcome="invalid_input") == 4
    assert value(samples, "vramguard_requests_total", model="synthetic", outcome="invalid_input") == 2
    assert value(samples, "vramguard_request_duration_seconds_count", model="", outcome="model_not_found") == 4
    labels = {dict(lbl)["model"] for lbl in matching(samples, "vramguard_requests_total")}
    assert not any(name.startswith("nope") for name in labels), labels
    assert value(samples, "vramguard_requests_in_flight", model="") in (None, 0)


MEMORY_FIELDS = {
    "device_kind": "sim", "mem_total_bytes": str(8 << 30), "mem_allocated_bytes": str(1 << 30),
    "mem_reserved_bytes": str(2 << 30), "mem_peak_bytes": str(3 << 29), "mem_budget_bytes": str(6 << 30),
    "oom_events": "2", "batch_splits": "3", "adaptive_batch_cap": "48", "plan_per_item_bytes": "1048576",
    "plan_batch_size": "40", "gpu": "1", "gpu_uuid": "SIM-1", "memory_share": "0.4",
}


async def beat_like_a_worker(redis: aioredis.Redis, keys: Keys, worker_id: str, fields: dict[str, str],
                             ttl_ms: int) -> None:
    """Write a heartbeat exactly as worker/health/heartbeat.py does: HSET + PEXPIRE + ZADD."""
    now_ms = int(time.time() * 1000)
    base = {"worker_id": worker_id, "model": "synthetic", "state": "ready", "healthy": "1", "device": "cpu",
            "pid": "1", "last_ok_ms": str(now_ms), "probe_interval_ms": "30000", "started_ms": str(now_ms)}
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.heartbeat(worker_id), mapping={**base, **fields})
        pipe.pexpire(keys.heartbeat(worker_id), ttl_ms)
        pipe.zadd(keys.worker_index("synthetic"), {worker_id: now_ms})
        await pipe.execute()


async def test_memory_fields_are_exported_and_vanish_with_the_heartbeat(gateway, redis_client, key_prefix) -> None:
    """1. A heartbeat hash with the memory and placement fields appears in Redis.
    2. It expires (the worker died).
    Result: its series exist with labels model, worker, device=sim, gpu and base units, then vanish."""
    await beat_like_a_worker(redis_client, Keys(key_prefix), "sim-0", MEMORY_FIELDS, ttl_ms=1000)
    worker = {"model": "synthetic", "worker": "sim-0", "device": "sim", "gpu": "1"}

    async def seen() -> bool:
        return value((await scrape(gateway))[0], "vramguard_worker_memory_allocated_bytes", **worker) is not None

    await wait_until(seen, 5)
    samples, types = await scrape(gateway)
    assert value(samples, "vramguard_worker_memory_total_bytes", **worker) == 8 << 30
    assert value(samples, "vramguard_worker_memory_allocated_bytes", **worker) == 1 << 30
    assert value(samples, "vramguard_worker_memory_reserved_bytes", **worker) == 2 << 30
    assert value(samples, "vramguard_worker_memory_peak_bytes", **worker) == 3 << 29
    assert value(samples, "vramguard_worker_memory_budget_bytes", **worker) == 6 << 30
    assert value(samples, "vramguard_worker_oom_events_total", **worker) == 2
    assert value(samples, "vramguard_worker_batch_splits_total", **worker) == 3
    assert value(samples, "vramguard_worker_adaptive_batch_cap", **worker) == 48
    assert value(samples, "vramguard_worker_plan_per_item_bytes", **worker) == 1048576
    assert value(samples, "vramguard_worker_plan_batch_size", **worker) == 40
    assert value(samples, "vramguard_worker_memory_share_ratio", **worker) == 0.4
    assert [dict(lbl)["gpu_uuid"] for lbl in matching(samples, "vramguard_worker_info", **worker)] == ["SIM-1"]
    assert types["vramguard_worker_oom_events"] == "counter"
    assert types["vramguard_worker_memory_allocated_bytes"] == "gauge"

    async def gone() -> bool:
        samples, _ = await scrape(gateway)
        return not matching(samples, "vramguard_worker_memory_allocated_bytes") and not matching(
            samples, "vramguard_worker_info", worker="sim-0")

    await wait_until(gone, 8)


async def test_a_malformed_heartbeat_does_not_break_the_scrape(gateway, redis_client, key_prefix) -> None:
    """1. A heartbeat (another version's worker, say) carries garbage numbers and histograms.
    Result: /metrics still answers; the garbage fields are skipped, the good ones exported."""
    fields = {"mem_allocated_bytes": "lots", "mem_total_bytes": "nan", "histograms": '{"batch_size": [1]}',
              "oom_events": "1", "plan_../x": "3"}
    await beat_like_a_worker(redis_client, Keys(key_prefix), "odd-0", fields, ttl_ms=5000)
    worker = {"model": "synthetic", "worker": "odd-0", "device": "cpu", "gpu": ""}

    async def seen() -> bool:
        return value((await scrape(gateway))[0], "vramguard_worker_oom_events_total", **worker) == 1

    await wait_until(seen, 5)
    samples, _ = await scrape(gateway)
    assert not matching(samples, "vramguard_worker_memory_allocated_bytes")
    assert not matching(samples, "vramguard_worker_memory_total_bytes")
    assert not matching(samples, "vramguard_batch_size_count", worker="odd-0")


async def test_queue_pending_and_in_flight_series_count_real_entries(
    gateway, start_worker, redis_client: aioredis.Redis, key_prefix
) -> None:
    """1. A slow request is being served: in flight 1 at the gateway.
    2. With no worker reading, 3 entries wait; a consumer takes 2 and does not ack them.
    3. A pack of 4 requests is added, as the admission script adds a call's requests.
    Result: queue depth 1 and pending entries 2, as Redis' consumer group says; then 3 requests
    queued or in flight, then 7 (the pack counts 4)."""
    handle = await start_worker(model="synthetic", models={"synthetic": {"params": {"batch_ms": 600}}})

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    slow = asyncio.create_task(gateway.post("/v1/models/synthetic/infer", json={"inputs": [1]}))

    async def one_in_flight() -> bool:
        return value((await scrape(gateway))[0], "vramguard_requests_in_flight", model="synthetic") == 1

    await wait_until(one_in_flight, 5, interval_s=0.02)
    assert (await slow).status_code == 200
    await handle.stop()

    stream = Keys(key_prefix).request_stream("synthetic")
    for i in range(3):
        await redis_client.xadd(stream, {b"m": str(i).encode()})
    await redis_client.xreadgroup(GROUP, "ghost", {stream: ">"}, count=2)
    samples, _ = await scrape(gateway)
    assert value(samples, "vramguard_queue_depth", model="synthetic") == 1
    assert value(samples, "vramguard_pending_entries", model="synthetic") == 2
    assert value(samples, "vramguard_requests_in_flight", model="synthetic") == 0
    assert value(samples, "vramguard_queued_requests", model="synthetic") == 3  # the stream's entries: a floor
    await redis_client.xadd(stream, {REQUESTS_FIELD: pack_requests([b"a", b"b", b"c", b"d"])})
    await redis_client.set(Keys(key_prefix).queued_requests("synthetic"), 7)
    samples, _ = await scrape(gateway)
    assert value(samples, "vramguard_queued_requests", model="synthetic") == 7
    assert value(samples, "vramguard_queue_depth", model="synthetic") == 2  # entries
