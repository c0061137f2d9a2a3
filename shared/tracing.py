"""OpenTelemetry traces across the broker: one request, one trace, from the gateway through the
request stream and the worker's batch back to the reply.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and
`OTEL_SDK_DISABLED` is not true: the OpenTelemetry specification's own variables, read by the
SDK (https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/), so
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*` and
`OTEL_EXPORTER_OTLP_HEADERS` work as they do for any OpenTelemetry service. Spans leave through
the SDK's BatchSpanProcessor and its OTLP/HTTP (protobuf) exporter, the protocol the
specification makes the default. When off, nothing of OpenTelemetry is imported and every hook
below returns at its first line: the hot path pays one global read per request and per batch.

The context crosses Redis inside the msgpack request (`RequestMessage.trace`, a W3C trace
context carrier: `traceparent`, and `tracestate` when there is one), so a worker's spans, a
reclaimed request's second delivery included, join the gateway's trace.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from vramguard.shared.clock import clock_offset_ms
from vramguard.shared.protocol import ReplyMessage

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
INSTRUMENTATION = "vramguard"
# Attribute names: the project's own under "vramguard.", OpenTelemetry's where one exists.
ATTR_MODEL = "vramguard.model"
ATTR_REQUEST_ID = "vramguard.request_id"
ATTR_OUTCOME = "vramguard.outcome"  # as the requests_total label: ok or the error code
ATTR_QUEUE_BOUND = "vramguard.queue_bound"

_tracer: Tracer | None = None
_OFF: AbstractContextManager[None] = nullcontext()  # reentrant: one for every block while tracing is off


class TracingError(RuntimeError):
    """Tracing is asked for (an OTLP endpoint is set) but cannot run as configured; the message
    says which variable or package."""


def enabled_in(environ: Mapping[str, str]) -> bool:
    """True when `environ` asks for traces: an OTLP endpoint is set and the SDK is not disabled."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def configure_tracing(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Install the SDK's tracer provider with an OTLP/HTTP exporter when `environ` asks for traces
    (`enabled_in`); `service_name` ("vramguard-gateway", "vramguard-worker") unless
    OTEL_SERVICE_NAME names one. Call once per process, before serving. Returns whether tracing is on.

    Raises TracingError: the OpenTelemetry packages are missing (the `tracing` extra), or the OTLP
    protocol variable names another protocol than http/protobuf.
    """
    global _tracer
    if not enabled_in(environ):
        return False
    protocol = next((environ[name] for name in PROTOCOL_VARIABLES if environ.get(name)), "http/protobuf")
    if protocol.strip() != "http/protobuf":
        raise TracingError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: vramguard exports traces over http/protobuf")
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingError(f"an OTLP endpoint is set but OpenTelemetry is not installed ({exc.name}): "
                           "pip install 'vramguard[tracing]'") from exc
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))  # shuts down (flushes) at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer(INSTRUMENTATION)
    return True


def tracer() -> Tracer | None:
    """The process's tracer, or None when tracing is off (then callers do nothing)."""
    return _tracer


def set_tracer(value: Tracer | None) -> None:
    """Replace the process's tracer (None turns tracing off): for tests that collect spans in memory."""
    global _tracer
    _tracer = value


def server_span(headers: Mapping[str, str], model: str, request_id: str) -> AbstractContextManager[Span | None]:
    """The gateway's span of one inference request, current while the block runs, continuing the
    client's trace when `headers` carry a W3C `traceparent`. Yields None when tracing is off."""
    return _OFF if _tracer is None else _server_span(_tracer, headers, model, request_id)


def child_span(name: str, attributes: Mapping[str, str | int | float | bool] | None = None,
               ) -> AbstractContextManager[Span | None]:
    """A span under the current one (the gateway's admission and reply wait); yields None when off."""
    return _OFF if _tracer is None else _tracer.start_as_current_span(name, attributes=attributes)


@contextmanager
def _server_span(tracer: Tracer, headers: Mapping[str, str], model: str, request_id: str) -> Iterator[Span]:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span("vramguard.request", context=propagate.extract(headers), kind=SpanKind.SERVER,
                                      attributes={ATTR_MODEL: model, ATTR_REQUEST_ID: request_id}) as span:
        try:
            yield span
        except BaseException as exc:  # the SDK records it and marks the span an error; the code says which
            span.set_attribute(ATTR_OUTCOME, str(getattr(exc, "code", type(exc).__name__)))
            raise
        span.set_attribute(ATTR_OUTCOME, "ok")


def carrier() -> dict[str, str] | None:
    """The current trace context as a W3C carrier for the msgpack request, or None when tracing
    is off or no span is current."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    out: dict[str, str] = {}
    propagate.inject(out)
    return out or None


def remote_context(trace: Mapping[str, str] | None) -> Context | None:
    """The context a request carried (`carrier` on the gateway), or None when it carried none or
    tracing is off here."""
    if _tracer is None or not trace:
        return None
    from opentelemetry import propagate

    return propagate.extract(trace)


def shared_ms_to_ns(shared_ms: float) -> int:
    """A time on the shared clock (shared/clock.now_ms, epoch ms) as this host's epoch ns, the
    clock span timestamps use."""
    return int((shared_ms - clock_offset_ms()) * 1_000_000)


def now_ns() -> int:
    """This host's wall clock, epoch ns (what the SDK stamps spans with)."""
    return time.time_ns()


def reply_attributes(reply: ReplyMessage) -> dict[str, str | int | float]:
    """What a reply says about how it was served, as span attributes: the worker, the batch it
    joined (items), its queue delay (ms), its cost (the model's unit) and the error code, if any."""
    out: dict[str, str | int | float] = {
        "vramguard.worker_id": reply.worker_id, "vramguard.batch.size": reply.batch_size,
        "vramguard.queue_delay_ms": reply.queue_delay_ms, "vramguard.cost": reply.cost,
    }
    if reply.error_code is not None:
        out["vramguard.error_code"] = reply.error_code
    return out
