"""Wire protocol round trips: arrays keep dtype and shape, bad bytes are refused clearly."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from vramguard.shared.protocol import (
    ENTRY_FIELD,
    REPLIES_FIELD,
    ProtocolError,
    ReplyMessage,
    RequestId,
    RequestMessage,
    pack,
    unpack,
)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int64", "int32", "uint8", "bool"])
@pytest.mark.parametrize("shape", [(0,), (3,), (2, 3), (1, 0, 4)])
def test_array_round_trip_keeps_dtype_shape_and_values(dtype: str, shape: tuple[int, ...]) -> None:
    arr = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    out = unpack(pack({"a": arr}))
    assert isinstance(out, dict)
    assert out["a"].dtype == arr.dtype and out["a"].shape == arr.shape
    np.testing.assert_array_equal(out["a"], arr)


def test_non_finite_floats_survive_the_wire() -> None:
    arr = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    out = unpack(pack(arr))
    assert np.isnan(out[0]) and math.isinf(out[1]) and out[2] < 0


def test_object_arrays_are_refused() -> None:
    with pytest.raises(TypeError):
        pack(np.array(["a", None], dtype=object))


def test_request_round_trip() -> None:
    msg = RequestMessage(
        request_id=RequestId("r1"), model="minilm", inputs=["a", "b"], reply_to="p:rep:g",
        deadline_ms=2_000, enqueued_ms=1_000, parameters={"x": 1},
    )
    assert RequestMessage.decode(msg.encode()) == msg
    assert msg.n_items == 2


def test_reply_round_trip_with_arrays() -> None:
    emb = np.ones(384, dtype=np.float32)
    reply = ReplyMessage(request_id=RequestId("r1"), outputs=[emb], worker_id="w", batch_size=3, queue_delay_ms=1.5)
    back = ReplyMessage.decode(reply.encode())
    assert back.ok and back.batch_size == 3 and back.worker_id == "w"
    np.testing.assert_array_equal(back.outputs[0], emb)  # type: ignore[index]


def test_error_reply_round_trip() -> None:
    reply = ReplyMessage.failure(RequestId("r2"), "invalid_input", "bad")
    back = ReplyMessage.decode(reply.encode())
    assert not back.ok and back.error_code == "invalid_input" and back.error_message == "bad"


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 99, "request_id": "x"}),
        msgpack.packb({"v": 1, "request_id": 5}),
        msgpack.packb({"v": 1, "request_id": "x", "model": "m", "inputs": "not-a-list"}),
        msgpack.packb(msgpack.ExtType(7, b"zz")),
        msgpack.packb(msgpack.ExtType(42, msgpack.packb(["<f4", [5], b"\x00" * 4]))),  # 1 float, shape [5]
        msgpack.packb(msgpack.ExtType(42, msgpack.packb(["|O", [1], b"\x00" * 8]))),  # object dtype
    ],
)
def test_malformed_requests_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        RequestMessage.decode(data)


def test_a_batch_of_replies_round_trips_in_order_through_one_entry() -> None:
    emb = np.arange(4, dtype=np.float32)
    replies = [ReplyMessage(RequestId("a"), outputs=[emb], batch_size=3),
               ReplyMessage.failure(RequestId("b"), "invalid_input", "bad"),
               ReplyMessage(RequestId("c"), outputs=["x"], batch_size=3)]
    back = ReplyMessage.from_entry({REPLIES_FIELD: ReplyMessage.encode_many(replies)})
    assert [r.request_id for r in back] == ["a", "b", "c"]
    np.testing.assert_array_equal(back[0].outputs[0], emb)  # type: ignore[index]
    assert back[1].error_code == "invalid_input" and back[2].outputs == ["x"]


def test_an_entry_of_one_reply_or_of_none_is_read_as_such() -> None:
    reply = ReplyMessage(RequestId("a"), outputs=[1])
    assert ReplyMessage.from_entry({ENTRY_FIELD: reply.encode()}) == [reply]
    assert ReplyMessage.from_entry({b"init": b"1"}) == []


@pytest.mark.parametrize("data", [b"\xc1", msgpack.packb({"v": 1}), msgpack.packb([{"v": 1, "request_id": "a"}, 7])])
def test_a_malformed_batch_of_replies_raises_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ReplyMessage.from_entry({REPLIES_FIELD: data})
