"""The trace context inside the msgpack request: optional, additive, checked."""

from __future__ import annotations

import msgpack
import pytest

from vramguard.shared.protocol import ProtocolError, RequestId, RequestMessage, pack, unpack

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def message(**extra: object) -> RequestMessage:
    return RequestMessage(request_id=RequestId("r1"), model="minilm", inputs=["a"], reply_to="rep",
                          deadline_ms=2, enqueued_ms=1, **extra)  # type: ignore[arg-type]


def test_a_trace_carrier_travels_with_the_request() -> None:
    carrier = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    assert RequestMessage.decode(message(trace=carrier).encode()).trace == carrier


def test_without_tracing_the_request_carries_no_trace_context() -> None:
    """Off by default: the field is nil, which a reader that treats it as optional (every version
    of this one) takes as no context."""
    data = message().encode()
    assert msgpack.unpackb(data, raw=False)["trace"] is None and RequestMessage.decode(data).trace is None


def test_a_request_written_before_the_trace_field_existed_still_decodes() -> None:
    d = unpack(message().encode())
    assert isinstance(d, dict)
    del d["trace"]
    assert RequestMessage.decode(pack(d)) == message()


def test_a_reader_that_knows_no_trace_field_still_reads_the_request() -> None:
    """Additive: the known fields are read by name, the extra key is ignored."""
    d = unpack(message(trace={"traceparent": TRACEPARENT}).encode())
    assert isinstance(d, dict) and d["request_id"] == "r1" and d["inputs"] == ["a"]


@pytest.mark.parametrize("bad", [["traceparent"], {"traceparent": 1}, "00-ab"])
def test_a_malformed_trace_field_is_a_protocol_error(bad: object) -> None:
    d = unpack(message().encode())
    assert isinstance(d, dict)
    d["trace"] = bad
    with pytest.raises(ProtocolError, match="trace"):
        RequestMessage.decode(pack(d))
