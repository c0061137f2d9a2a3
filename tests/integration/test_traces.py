"""Traces across the broker with real processes: `python -m vramguard.gateway` and `python -m
vramguard.worker` export over OTLP/HTTP (OTEL_EXPORTER_OTLP_ENDPOINT) to a receiver in this test,
which decodes each export with OpenTelemetry's own protobuf messages (opentelemetry-proto)."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.helpers import Stack, wait_until

MIB = 1024 * 1024
CLOCK_SLACK_NS = 20_000_000  # the worker's shared clock (Redis TIME) against the gateway's: half a round trip
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
GATEWAY_SPANS = {"vramguard.request", "vramguard.admission", "vramguard.reply"}
WORKER_SPANS = {"vramguard.queued", "vramguard.batch", "vramguard.forward", "vramguard.publish"}


@dataclass(frozen=True)
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, object]
    start_ns: int
    end_ns: int


def _value(v: AnyValue) -> object:
    return getattr(v, v.WhichOneof("value") or "string_value")


class Receiver:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf) on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, export: ExportTraceServiceRequest) -> None:
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    span = Span(s.name, str(resource.get("service.name")), s.trace_id.hex(), s.span_id.hex(),
                                s.parent_span_id.hex(), s.kind, {a.key: _value(a.value) for a in s.attributes},
                                s.start_time_unix_nano, s.end_time_unix_nano)
                    with self._lock:
                        self.spans.append(span)

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def otel_env(receiver: Receiver) -> dict[str, str]:
    # OTEL_BSP_SCHEDULE_DELAY: the batch span processor exports every 100 ms instead of every 5 s.
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


async def spans_of(receiver: Receiver, trace_id: str, expected: dict[str, int]) -> dict[str, list[Span]]:
    """The spans of `trace_id` once at least `expected[name]` of each name have arrived."""

    async def arrived() -> bool:
        got = by_name(receiver.trace(trace_id))
        return all(len(got.get(name, [])) >= n for name, n in expected.items())

    await wait_until(arrived, 30)
    return by_name(receiver.trace(trace_id))


@pytest.mark.slow
async def test_one_request_is_one_trace_across_gateway_stream_and_worker(stack: Stack, receiver: Receiver) -> None:
    """1. A gateway and a worker (synthetic model on a 256 MiB simulated device, so it has a memory
       plan) export to the test's OTLP receiver.
    2. A client sends a request with a W3C traceparent.
    Result: the client's trace holds the gateway's request span (server kind, child of the client's
    span) with its admission and reply spans, and the worker's queued and batch spans under the
    request span, forward and publish under the batch; the batch span carries the batch size, cost
    and memory plan; the spans come from the two processes' services."""
    stack.start_gateway(otel_env(receiver), served_models="synthetic")
    stack.start_worker(otel_env(receiver), model="synthetic", device="sim", sim_memory_bytes=256 * MIB)
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        reply = await client.post("/v1/models/synthetic/infer", json={"inputs": [1, 2, 3]},
                                  headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert reply.status_code == 200, reply.text
    request_id = reply.json()["request_id"]
    spans = await spans_of(receiver, CLIENT_TRACE, {name: 1 for name in GATEWAY_SPANS | WORKER_SPANS})

    (root,) = spans["vramguard.request"]
    assert root.parent_id == CLIENT_SPAN and root.kind == 2 and root.service == "vramguard-gateway"  # 2: SERVER
    assert root.attributes["vramguard.request_id"] == request_id and root.attributes["vramguard.outcome"] == "ok"
    for name in ("vramguard.admission", "vramguard.reply", "vramguard.queued", "vramguard.batch"):
        (span,) = spans[name]
        assert span.parent_id == root.span_id, name
        # Inside the request's time; the worker's clock may differ from the gateway's by its sync error.
        slack_ns = 0 if span.service == "vramguard-gateway" else CLOCK_SLACK_NS
        assert span.start_ns >= root.start_ns - slack_ns and span.end_ns <= root.end_ns + slack_ns, name
    (batch,) = spans["vramguard.batch"]
    for name in ("vramguard.forward", "vramguard.publish"):
        (span,) = spans[name]
        assert span.parent_id == batch.span_id and span.service == "vramguard-worker", name
    assert spans["vramguard.forward"][0].end_ns <= spans["vramguard.publish"][0].start_ns
    assert batch.attributes["vramguard.batch.size"] == 3 and batch.attributes["vramguard.batch.cost"] == 3
    assert batch.attributes["vramguard.plan.budget_bytes"] == int(0.8 * 256 * MIB)
    # (204.8 budget - 12 outside the allocator (sim context 8 + modules 4) - 128 weights - 16 fixed) / 8 per item
    assert batch.attributes["vramguard.plan.planned_batch_size"] == 6
    assert batch.attributes["vramguard.request_id"] == request_id and batch.attributes["vramguard.delivery_count"] == 1
    (queued,) = spans["vramguard.queued"]
    # It ends where the batch starts (or, were the two processes' clocks apart by more than the delay, is empty).
    assert queued.end_ns == max(batch.start_ns, queued.start_ns) and queued.attributes["vramguard.delivery_count"] == 1
    assert spans["vramguard.reply"][0].attributes["vramguard.batch.size"] == 3


@pytest.mark.slow
async def test_a_reclaimed_request_shows_both_deliveries_in_its_trace(stack: Stack, receiver: Receiver) -> None:
    """1. A worker with fault injection on takes a {"fault": "hang"} request, whose forward never
       returns; once its queued span is exported the worker is SIGKILLed.
    2. Its successor starts under the same consumer name (as supervisor restarts it), without fault
       injection, claims the pending entry (delivery 2) and answers it (the synthetic model echoes).
    Result: the client gets 200, and the request's one trace holds both deliveries' queued spans
    (delivery_count 1 and 2) under the gateway's request span, and the batch that answered it,
    with delivery_count 2."""
    stack.start_gateway(otel_env(receiver), served_models="synthetic", fault_injection="true")
    hung = stack.start_worker(otel_env(receiver), model="synthetic", worker_name="traced", fault_injection="true")
    await stack.wait_ready()
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        answer = asyncio.ensure_future(client.post("/v1/models/synthetic/infer", json={"inputs": [{"fault": "hang"}]},
                                                   headers={"X-Request-Timeout-Ms": "100000"}))

        def queued() -> list[Span]:
            return [s for s in receiver.spans if s.name == "vramguard.queued"]

        await wait_until(lambda: bool(queued()), 30)
        hung.kill()
        hung.wait()
        stack.start_worker(otel_env(receiver), model="synthetic", worker_name="traced", fault_injection="false")
        reply = await answer
    assert reply.status_code == 200 and reply.json()["outputs"] == [{"fault": "hang"}], reply.text
    trace_id = queued()[0].trace_id
    spans = await spans_of(receiver, trace_id, {"vramguard.request": 1, "vramguard.queued": 2, "vramguard.batch": 1})
    (root,) = spans["vramguard.request"]
    first, second = sorted(spans["vramguard.queued"], key=lambda s: int(str(s.attributes["vramguard.delivery_count"])))
    assert (first.attributes["vramguard.delivery_count"], second.attributes["vramguard.delivery_count"]) == (1, 2)
    assert first.parent_id == second.parent_id == root.span_id and first.span_id != second.span_id
    (batch,) = spans["vramguard.batch"]
    assert batch.parent_id == root.span_id and batch.attributes["vramguard.delivery_count"] == 2
    assert root.attributes["vramguard.request_id"] == reply.json()["request_id"]
