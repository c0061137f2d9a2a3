"""Structured logs: one JSON object per event on stderr, through the standard logging module
and python-json-logger. Pass event fields with `extra={...}` (request_id, model, worker_id,
batch_size, queue_delay_ms, duration_ms)."""

from __future__ import annotations

import logging
import sys
import threading
from types import TracebackType

from pythonjsonlogger.json import JsonFormatter


def configure_logging(level: str, service: str) -> None:
    """Route every logger to stderr as JSON lines tagged with `service` (gateway or worker)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "asctime": "ts", "name": "logger"},
            static_fields={"service": service},
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # What Python itself writes to stderr would otherwise be plain text among the JSON lines: a
    # warning, an exception no code caught (main thread or another), or one raised where nothing
    # can take it (a __del__, a callback at interpreter exit). Each becomes one JSON event.
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda args: _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback,
                                                      thread=args.thread.name if args.thread else None)
    sys.unraisablehook = _log_unraisable


def _log_uncaught(exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None,
                  thread: str | None = None) -> None:
    logging.getLogger("vramguard.uncaught").critical(
        "uncaught exception", exc_info=(exc_type, exc or exc_type(), tb), extra={"in_thread": thread} if thread else {})


def _log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    exc = unraisable.exc_value or unraisable.exc_type()
    logging.getLogger("vramguard.unraisable").error(
        unraisable.err_msg or "exception ignored", exc_info=(unraisable.exc_type, exc, unraisable.exc_traceback),
        extra={"object": repr(unraisable.object)})
