"""Wire messages between gateway and workers: msgpack, never pickle.

A request travels on its model's request stream: alone, as an entry with field `m` holding a
packed `RequestMessage`, or with other requests admitted in the same gateway call, as an entry
with field `ms` holding a msgpack array of packed requests (one XADD and one entry for the lot;
the gateway's admission script writes it, worker/batch/entries.py splits it). A
reply travels on the gateway's reply stream: alone, as an entry with field `m` holding a packed
`ReplyMessage`, or with the other replies of one batch to the same gateway, as an entry with
field `ms` holding a packed list of them (one XADD and one entry per gateway per batch instead of
one per request). Arrays travel as a msgpack extension (type `ARRAY_EXT`) whose payload is
`[dtype.str, shape, raw C-order bytes]`, so a float32 [384] embedding costs 1.5 KiB, not JSON.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NewType, TypeAlias, TypeVar

import msgpack
import msgspec
import numpy as np

from vramguard.shared.errors import InvalidInputError

PROTOCOL_VERSION = 1
ARRAY_EXT = 42
ENTRY_FIELD = b"m"
REPLIES_FIELD = b"ms"
# On a request stream the same name holds several requests: "m" is one message, "ms" several.
REQUESTS_FIELD = REPLIES_FIELD
# An entry split from a pack whose worker died (worker/batch/reclaim.py) carries the pack's deliveries so
# far, so max_deliveries counts a request's deliveries, not its entry's.
PRIOR_DELIVERIES_FIELD = b"d"

RequestId = NewType("RequestId", str)


def new_request_id() -> RequestId:
    """A fresh request id: 32 random hex digits (128 bits from the OS' CSPRNG, `secrets.token_hex`;
    about a fifth of what `uuid.uuid4().hex` costs, and a request pays for one on the gateway)."""
    return RequestId(secrets.token_hex(16))
EntryId = NewType("EntryId", str)

# What may travel as an input or an output value: msgpack natives plus numpy arrays.
Value: TypeAlias = "None | bool | int | float | str | bytes | np.ndarray | list[Value] | dict[str, Value]"

_ALLOWED_DTYPES = frozenset({"|b1", "|u1", "|i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<f2", "<f4", "<f8"})


class ProtocolError(InvalidInputError):
    """Bytes that are not a valid message of this protocol version."""


def _default(obj: object) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype.str not in _ALLOWED_DTYPES:
            raise TypeError(f"dtype {arr.dtype} cannot travel on the wire")
        payload = msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()], use_bin_type=True)
        return msgpack.ExtType(ARRAY_EXT, payload)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def _ext_hook(code: int, data: bytes | memoryview) -> object:
    if code != ARRAY_EXT:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    dtype, shape, raw = msgpack.unpackb(data, raw=False)
    if dtype not in _ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {dtype!r} is not allowed on the wire")
    arr = np.frombuffer(raw, dtype=np.dtype(dtype))
    try:
        return arr.reshape(shape)
    except ValueError as exc:
        raise ProtocolError(f"array of {arr.size} elements does not fit shape {shape}") from exc


def pack(obj: object) -> bytes:
    """Encode msgpack natives and numpy arrays. Raises TypeError for anything else."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> object:
    """Decode what `pack` wrote. Raises ProtocolError on malformed bytes."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc


def pack_requests(packed: Sequence[bytes]) -> bytes:
    """The value of a REQUESTS_FIELD entry: already packed requests as one msgpack array. The
    gateway's admission script writes the same array with Lua's cmsgpack (as str, not bin: both
    read back as bytes); this one is for tests and tools."""
    return msgpack.packb(list(packed), use_bin_type=True)  # type: ignore[no-any-return]


def split_requests(data: bytes) -> list[bytes]:
    """The packed requests a REQUESTS_FIELD value carries, in admission order, each still to be
    decoded (`RequestMessage.decode`: one malformed request does not spoil the others). Raises
    ProtocolError when the value is not a non-empty array of byte strings."""
    try:
        parts = msgpack.unpackb(data, raw=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed request list: {exc}") from exc
    if not isinstance(parts, list) or not parts or not all(isinstance(p, bytes) for p in parts):
        raise ProtocolError("not a list of packed requests")
    return parts


T = TypeVar("T")


def _enc_hook(obj: object) -> object:
    """msgspec's hook for what it cannot encode itself: numpy arrays and scalars, as `pack` does."""
    value = _default(obj)
    return msgspec.msgpack.Ext(value.code, value.data) if isinstance(value, msgpack.ExtType) else value


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    try:
        return decoder.decode(data)
    except ProtocolError:  # from _ext_hook: an array that may not travel
        raise
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise ProtocolError(f"not a {what} message of protocol version {PROTOCOL_VERSION}: {exc}") from exc


class RequestMessage(msgspec.Struct, frozen=True, tag_field="v", tag=PROTOCOL_VERSION):
    """One client request as a worker sees it.

    `inputs` holds one value per item (a request with 3 inputs counts 3 toward
    `max_batch_size`); `deadline_ms` and `enqueued_ms` are epoch ms (shared.clock.now_ms);
    `reply_to` is the gateway's reply stream key. `trace` is the W3C trace context of the gateway's
    request span (`traceparent`, `tracestate`; shared/tracing.py), None when tracing is off.

    On the wire a msgpack map of these fields plus `"v": PROTOCOL_VERSION` (msgspec's tag field),
    written and read by msgspec in C: the fields' types are checked while decoding, straight into
    the struct, with no dict in between (about a tenth of msgpack-python plus a dataclass per
    message, which the gateway and the worker each paid per request).
    """

    request_id: RequestId
    model: str
    inputs: list[Any]
    reply_to: str
    deadline_ms: int
    enqueued_ms: int
    parameters: dict[str, Any] = {}
    trace: dict[str, str] | None = None

    @property
    def n_items(self) -> int:
        return len(self.inputs)

    def encode(self) -> bytes:
        """Raises TypeError for an input that cannot travel (see `pack`)."""
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> RequestMessage:
        """Raises ProtocolError for bytes that are not a version-1 request."""
        return _decode(_REQUEST_DECODER, data, "request")


class ReplyMessage(msgspec.Struct, frozen=True, tag_field="v", tag=PROTOCOL_VERSION):
    """A worker's answer to one request: `outputs` (one value per input) or an error.

    `error_code` is one of shared.errors' codes; `batch_size` is the number of items in the
    forward that served it; `queue_delay_ms` is enqueue to batch start; `cost` is the sum of the
    request's item costs in the model's unit (tokens for text: the usage the OpenAI route reports).
    On the wire as `RequestMessage` is: a msgpack map with `"v": PROTOCOL_VERSION`.
    """

    request_id: RequestId
    outputs: list[Any] | None = None
    error_code: str | None = None
    error_message: str | None = None
    worker_id: str = ""
    batch_size: int = 0
    queue_delay_ms: float = 0.0
    cost: int = 0

    @property
    def ok(self) -> bool:
        return self.error_code is None

    def encode(self) -> bytes:
        """Raises TypeError for an output that cannot travel (see `pack`)."""
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ReplyMessage:
        """Raises ProtocolError for bytes that are not a version-1 reply."""
        return _decode(_REPLY_DECODER, data, "reply")

    @classmethod
    def encode_many(cls, replies: Sequence[ReplyMessage]) -> bytes:
        """The value of a REPLIES_FIELD entry: `replies` packed as one msgpack array (one encode
        call for the batch). Raises TypeError for an output that cannot travel (as `encode`)."""
        return _ENCODER.encode(list(replies))

    @classmethod
    def decode_many(cls, data: bytes) -> list[ReplyMessage]:
        """What `encode_many` wrote, in its order. Raises ProtocolError when the bytes or any
        reply in them are not of protocol version 1 (the entry's other replies are then lost
        with it, as a single entry's reply would be)."""
        return _decode(_REPLIES_DECODER, data, "reply list")

    @classmethod
    def from_entry(cls, fields: Mapping[bytes, bytes]) -> list[ReplyMessage]:
        """The replies one reply-stream entry carries: one (ENTRY_FIELD), a batch's
        (REPLIES_FIELD), or none (any other entry, such as the one that creates the stream).
        Raises ProtocolError for bytes that are not replies of protocol version 1."""
        if (data := fields.get(ENTRY_FIELD)) is not None:
            return [cls.decode(data)]
        if (data := fields.get(REPLIES_FIELD)) is not None:
            return cls.decode_many(data)
        return []

    @classmethod
    def failure(cls, request_id: RequestId, code: str, message: str, **kw: object) -> ReplyMessage:
        return cls(request_id=request_id, error_code=code, error_message=message, **kw)  # type: ignore[arg-type]


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_REQUEST_DECODER = msgspec.msgpack.Decoder(RequestMessage, ext_hook=_ext_hook)
_REPLY_DECODER = msgspec.msgpack.Decoder(ReplyMessage, ext_hook=_ext_hook)
_REPLIES_DECODER = msgspec.msgpack.Decoder(list[ReplyMessage], ext_hook=_ext_hook)
