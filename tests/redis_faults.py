"""Every error a redis-py client can meet on one connection, as the bytes a (proxied) Redis sends
for it: one error line per entry of redis-py's own table of error prefixes and messages
(`BaseParser.EXCEPTION_CLASSES`, so a new redis-py's additions are covered too), a generic error,
a connection cut (ConnectionError), a stall (TimeoutError), bytes that are not RESP
(InvalidResponse) and replies of a shape the command does not expect (redis-py's parsing then
raises TypeError or ValueError, not a RedisError)."""

from __future__ import annotations

from redis._parsers.base import BaseParser

from tests.proxy import CUT, STALL


def error_lines() -> list[bytes]:
    """One RESP error line per (prefix, message) redis-py maps to an exception class."""
    lines = [b"-ERR injected generic error\r\n", b"-WRONGTYPE injected\r\n", b"-BUSY injected\r\n"]
    for prefix, target in BaseParser.EXCEPTION_CLASSES.items():
        if isinstance(target, dict):
            lines += [f"-{prefix} {message}\r\n".encode() for message in target]
        else:
            argument = "3999 127.0.0.1:1" if prefix in ("MOVED", "ASK") else "injected"
            lines.append(f"-{prefix} {argument}\r\n".encode())
    return lines


def all_faults(*, stall: bool = True) -> list[bytes]:
    """error_lines, then the connection and protocol faults and replies of the wrong shape."""
    wrong_shape = [b"+OK\r\n", b":7\r\n", b"*1\r\n$1\r\nx\r\n", b"*2\r\n*1\r\n$1\r\nx\r\n$1\r\ny\r\n"]
    return [*error_lines(), CUT, *([STALL] if stall else []), b"!garbage\r\n", *wrong_shape]
