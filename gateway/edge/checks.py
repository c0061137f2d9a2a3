"""The request checks every inference route shares, whatever its protocol: media type, body
receipt (size cap, gzip), declared parameters, and the gateway's half of the input-length policy.

Each raises a VramguardError; the route's protocol module renders it in its own error shape.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Mapping

import regex
from starlette.requests import ClientDisconnect, Request

from vramguard.gateway.edge.bodybudget import STATE_KEY, BodyHold
from vramguard.shared.errors import (
    InputTooLongError,
    InvalidInputError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    VramguardError,
)
from vramguard.shared.models import ModelSpec, ParameterSpec

MAX_TIMEOUT_MS = 3_600_000  # the largest timeout_ms (body) or X-Request-Timeout-Ms (header)
_VISIBLE = regex.compile(r"[^\p{C}\p{Z}]")  # a character that is neither C* nor Z*

JSON = "application/json"
_WBITS = {"identity": 0, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # zlib's framing per encoding
_PARAMETER_TYPES: dict[str, tuple[type, ...]] = {
    "boolean": (bool,), "integer": (int,), "number": (int, float), "string": (str,),
}


def require_media_type(request: Request, accepted: Collection[str], *, allow_missing: bool = False) -> None:
    """Raise UnsupportedMediaTypeError (415) unless the Content-Type's media type is in `accepted`
    (parameters such as charset are ignored). `allow_missing`: a request without Content-Type
    passes (KServe v2 clients send none); elsewhere it is refused, so a cross-site form cannot
    reach inference (a browser sends text/plain or a form type without a preflight). More than one
    Content-Type header is BadBodyError (400)."""
    given = request.headers.getlist("content-type")
    if len(given) > 1:  # a singleton field (RFC 9110 5.3): two differing types leave the body's meaning open
        raise BadBodyError(f"{len(given)} Content-Type headers; send one")
    value = given[0] if given else None
    if value is None:
        if allow_missing:
            return
        raise UnsupportedMediaTypeError(f"no Content-Type; send {' or '.join(sorted(accepted))}")
    media_type = value.split(";", 1)[0].strip().lower()
    if media_type not in accepted:
        raise UnsupportedMediaTypeError(
            f"Content-Type {media_type[:100]!r} is not accepted here; send {' or '.join(sorted(accepted))}"
        )


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, decompressed when Content-Encoding is gzip or deflate (zlib, as tritonclient sends).

    Raises PayloadTooLargeError (413) when the body, or its decompressed form, is over
    `limit_bytes` (decompression stops there: a small bomb costs at most `limit_bytes`),
    UnsupportedMediaTypeError (415) for another encoding, InvalidInputError (400) for bad gzip.
    """
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in _WBITS:
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {encoding[:40]!r} is not accepted; send identity, gzip or deflate")
    raw = await _read_raw(request, limit_bytes)
    if encoding == "identity":
        return raw
    inflater = zlib.decompressobj(wbits=_WBITS[encoding])
    try:
        body = inflater.decompress(raw, limit_bytes + 1)
    except zlib.error as exc:
        raise BadBodyError(f"Content-Encoding {encoding} but the body is not valid {encoding} ({exc})") from exc
    if len(body) > limit_bytes or inflater.unconsumed_tail:
        raise PayloadTooLargeError(f"decompressed body is over the {limit_bytes}-byte limit")
    if not inflater.eof:
        raise BadBodyError(f"Content-Encoding {encoding} but the stream is truncated")
    if inflater.unused_data:  # junk, or a second gzip member: what was sent is not what is read
        raise BadBodyError(f"Content-Encoding {encoding} but {len(inflater.unused_data)} bytes follow the end of "
                           "its stream (send one stream)")
    return body


class ClientGoneError(VramguardError):
    """The client hung up (or broke the framing, which the HTTP server answers itself) before its
    body arrived. Counted under its own outcome and logged at DEBUG: not a gateway bug, and
    nothing to answer (499, nginx's "client closed request", for the record only)."""

    code = "client_disconnected"
    http_status = 499


class BadBodyError(InvalidInputError):
    """A body that cannot be read at all (broken framing or compression): 400, not 422."""

    http_status = 400


async def _read_raw(request: Request, limit_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    known = declared is not None and is_ascii_number(declared, max_digits=19)
    if known and int(declared) > limit_bytes:  # type: ignore[arg-type]
        raise PayloadTooLargeError(f"body of {declared} bytes is over the {limit_bytes}-byte limit")
    hold: BodyHold | None = getattr(request.state, STATE_KEY, None)  # gateway/edge/bodybudget.py
    if hold is not None and known:
        hold.take(int(declared))  # type: ignore[arg-type]  # all of it at once: before a byte is read
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit_bytes:
                raise PayloadTooLargeError(f"body is over the {limit_bytes}-byte limit")
            if hold is not None and len(body) > hold.bytes:  # chunked, or longer than declared
                hold.take(len(body) - hold.bytes)
    except ClientDisconnect as exc:
        raise ClientGoneError(f"the client disconnected after {len(body)} bytes of its body") from exc
    return bytes(body)


def is_ascii_number(value: str, max_digits: int) -> bool:
    """ASCII digits only, at most `max_digits` of them (int() refuses other digits and very long strings)."""
    return value.isascii() and value.isdigit() and len(value) <= max_digits


def check_parameters(spec: ModelSpec, parameters: Mapping[str, object]) -> None:
    """Raise InvalidInputError (422) for a parameter `spec` does not declare, naming it and the
    declared ones, or for a value of the wrong JSON type."""
    for name, value in parameters.items():
        declared: ParameterSpec | None = spec.parameters.get(name)
        if declared is None:
            known = ", ".join(sorted(spec.parameters)) or "none"
            raise InvalidInputError(f"parameters.{name[:100]}: model {spec.name!r} has no such parameter; "
                                    f"it takes: {known}")
        kinds = _PARAMETER_TYPES[declared.type]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise InvalidInputError(f"parameters.{name}: must be of type {declared.type}")


def check_text_length(spec: ModelSpec, index: int, text: str, truncate: bool) -> str:
    """The gateway's half of the input-length policy for one text input; returns the text to send.

    The length policy comes first, so no check reads more than the model can accept: a text
    longer than `spec.max_input_chars` (the most a window of tokens can span) is refused with
    InputTooLongError (413), or cut there when `truncate`: the worker then tokenizes a bounded
    text, however large the body. Then a text with no visible character is refused like an empty
    one (InvalidInputError). The exact token count is the worker's to check.
    """
    limit = spec.max_input_chars
    if limit is not None and len(text) > limit:
        if not truncate:
            raise InputTooLongError(
                f"inputs[{index}]: {len(text)} characters, more than the {limit} that the model's "
                f"{spec.max_input_tokens}-token window can span; {InputTooLongError.HINT}"
            )
        text = text[:limit]
    if not has_visible_character(text):
        raise InvalidInputError(f"inputs[{index}]: empty, or only whitespace, invisible or control characters")
    return text


def has_visible_character(text: str) -> bool:
    """Whether `text` holds a character outside Unicode's categories C* (control, format such as
    U+200B, unassigned) and Z* (separators), which carry no token. One search in the `regex`
    package's C engine: about 10 ns a character, where a Python loop over 8 MiB of U+200B took
    seconds of the event loop."""
    return _VISIBLE.search(text) is not None


def header_timeout(value: str | None) -> int | None:
    """X-Request-Timeout-Ms as ms, or None when absent. Raises InvalidInputError (422) unless it is
    ASCII digits between 1 and MAX_TIMEOUT_MS ("²" passes str.isdigit but not int())."""
    if value is None:
        return None
    if not is_ascii_number(value, max_digits=len(str(MAX_TIMEOUT_MS))) or not 1 <= int(value) <= MAX_TIMEOUT_MS:
        raise InvalidInputError(f"X-Request-Timeout-Ms must be an integer number of ms between 1 and {MAX_TIMEOUT_MS}")
    return int(value)
