"""The HTTP server's own limits against untrusted clients, where uvicorn has no knob: a deadline
for a request's headers and one for its body, a connection cap, and caps on the count and size of
headers (431). Built on uvicorn's httptools protocol, whose parser (llhttp, httptools >= 0.9)
rejects ambiguous framing: Content-Length with Transfer-Encoding, and obs-fold headers (400, then
the connection is closed, so no request can hide in another's body).

Limits (Settings, `http_*`):
    header deadline: from the connection's start, or a kept-alive request's first byte, to the
        end of its headers; past it, 408 and close (slowloris: headers a byte at a time).
    body deadline: from the end of the headers to the end of the body; past it the connection is
        closed and the request counts as `client_disconnected` (a body that never finishes).
    connections: past the cap, a new connection takes the place of the connection that has been
        sending its headers the longest (408 and close: slowloris holds the cap with headers a byte
        a second, and a well-behaved client or a /health/* probe sends its headers within
        milliseconds, so it is never that one); when none is within its headers, it takes the place
        of the connection kept alive idle the longest (closed, as its keep-alive timeout would:
        nginx likewise reuses idle keep-alive connections when it runs out, and a client's pool
        opens a new one; else a thousand idle sockets would lock every client and probe out for
        `http_keep_alive_s`); only when every connection has a request being served is the new one
        closed at once, before reading a byte.
    headers: more than `http_max_headers` headers, or more than `http_max_header_bytes` of request
        line and headers together, get 431 and close.
    keep-alive: an idle kept-alive connection is closed after `http_keep_alive_s` (uvicorn's).

The header and body deadlines are coarse timers (gateway/edge/coarsetimers.py), one set per server,
checked every tenth of the shorter of the two, so a deadline is enforced up to that late: a timer
of their own would be two per request (armed at its first byte, re-armed at the end of its
headers).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable
from typing import ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from vramguard.gateway.edge.coarsetimers import CoarseTimers
from vramguard.shared.settings import Settings

log = logging.getLogger(__name__)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing and answer `status` then close."""

    def __init__(self, status: bytes) -> None:
        super().__init__(status.decode())
        self.status = status


# A deadline is enforced up to 1/CHECKS_PER_DEADLINE of the shorter of the two deadlines late.
CHECKS_PER_DEADLINE = 10

# The order in which connections went idle (a response complete, kept alive). uvicorn's keep-alive
# timers cannot give it: uvloop's `TimerHandle.when()` is libuv's loop time, in whole milliseconds and
# cached per loop iteration, so connections that went idle within one millisecond tie, and the
# connection closed at the cap was then any of them (measured: the second-longest idle one, in 1 of
# 7-12 runs of the cap test).
_IDLE_ORDER = itertools.count()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines, a connection cap and header caps.
    `settings` is set on the subclass `protocol_class` builds; `deadlines`, on it too, by the
    first connection of the server: its connections' header and body deadlines, by connection."""

    settings: ClassVar[Settings]
    deadlines: ClassVar[CoarseTimers | None] = None
    # The connections within their headers, oldest first (dicts keep insertion order): set with
    # `deadlines`, for the same server.
    heads: ClassVar[dict[GuardedHttpToolsProtocol, None]] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._idle_since = 0  # a count of _IDLE_ORDER, taken when a response completes
        self._header_count = 0
        self._header_bytes = 0
        super().connection_made(transport)
        cls = type(self)
        if cls.deadlines is None or cls.deadlines.loop is not self.loop:  # a server run again on a new loop
            shortest_s = min(self.settings.http_header_timeout_s, self.settings.http_body_timeout_s)
            cls.deadlines = CoarseTimers(self.loop, shortest_s / CHECKS_PER_DEADLINE)
            cls.heads = {}
        if len(self.connections) > self.settings.http_max_connections and not (
                self._evict_slowest_head() or self._evict_idlest()):
            log.debug("connection refused: at the cap", extra={"connections": len(self.connections)})
            transport.close()
            return
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _evict_slowest_head(self) -> bool:
        """Close (408) the connection that has been within its headers the longest, to make room
        for a new one at the cap; False when no connection is within its headers."""
        if not self.heads:
            return False
        slowest = next(iter(self.heads))
        log.debug("at the connection cap: closing the slowest head", extra={"client": slowest.client})
        slowest._refuse(b"408 Request Timeout")
        return True

    def _evict_idlest(self) -> bool:
        """Close the connection kept alive idle the longest (uvicorn arms its keep-alive timer when
        a response completes and cancels it at the next request's first byte: a connection with a
        timer is idle; `_IDLE_ORDER` says since when), to make room at the cap; False when none is
        idle. Scans the connections: only past the cap."""
        idle = [c for c in self.connections
                if isinstance(c, GuardedHttpToolsProtocol) and c.timeout_keep_alive_task is not None]
        if not idle:
            return False
        idlest = min(idle, key=lambda c: c._idle_since)
        log.debug("at the connection cap: closing the longest idle", extra={"client": idlest.client})
        idlest.timeout_keep_alive_handler()
        return True

    def _arm_head(self) -> None:
        self._arm(self.settings.http_header_timeout_s, self._headers_late)
        self.heads.pop(self, None)  # to the end: the newest head
        self.heads[self] = None

    def data_received(self, data: bytes) -> None:
        """uvicorn's, except that a malformed request is logged at DEBUG (any client can send
        them: not worth a WARNING each) and a refusal from our callbacks answers its own status."""
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            # A callback's exception arrives wrapped (HttpParserCallbackError) with it as context.
            refused = exc.__context__ if isinstance(exc.__context__, _Refused) else None
            log.debug("malformed or refused request; closing", extra={"client": self.client, "error": str(exc)})
            self._refuse(refused.status if refused else b"400 Bad Request")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        self._header_bytes = 0
        if self not in self._deadlines:  # a kept-alive connection's next request: its own deadline
            self._arm_head()

    def on_url(self, url: bytes) -> None:
        self._count_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.settings.http_max_headers:
            self._stop(b"431 Request Header Fields Too Large")
        self._count_bytes(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.heads.pop(self, None)
        self._arm(self.settings.http_body_timeout_s, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = next(_IDLE_ORDER)

    def _count_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.settings.http_max_header_bytes:
            self._stop(b"431 Request Header Fields Too Large")

    def _stop(self, status: bytes) -> None:
        raise _Refused(status)

    def _refuse(self, status: bytes) -> None:
        self._disarm()
        if not self.transport.is_closing():
            body = status.split(b" ", 1)[1]
            self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                 + body)
            self.transport.close()

    @property
    def _deadlines(self) -> CoarseTimers:
        assert self.deadlines is not None  # set by the server's first connection_made
        return self.deadlines

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._deadlines.call_later(self, delay_s, callback)

    def _disarm(self) -> None:
        self._deadlines.cancel(self)
        self.heads.pop(self, None)

    def _headers_late(self) -> None:
        log.debug("request headers not received in time; closing", extra={"client": self.client})
        self._refuse(b"408 Request Timeout")

    def _body_late(self) -> None:
        log.debug("request body not received in time; closing", extra={"client": self.client})
        if not self.transport.is_closing():
            self.transport.close()  # the app's receive() sees a disconnect: outcome client_disconnected


def protocol_class(settings: Settings) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to `settings`' limits."""
    return type("BoundHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"settings": settings})


def uvicorn_options(settings: Settings) -> dict[str, object]:
    """uvicorn.Config keyword arguments: the HTTP limits uvicorn has knobs for, and the event loop."""
    return {
        "http": protocol_class(settings),
        "loop": settings.event_loop,
        "timeout_keep_alive": settings.http_keep_alive_s,
        "server_header": False,  # do not announce the server software to clients
    }


def shared_port_socket(settings: Settings) -> socket.socket:
    """The listening socket of one of several gateway processes on `settings.host:port`, bound with
    SO_REUSEPORT so that each process has its own accept queue and the kernel spreads new
    connections over them (uvicorn's own `workers` would fork children of one server, without
    gateway/__main__.py's drain). Raises OSError when the port is held without SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((settings.host, settings.port))
    return sock
