"""Structured logs: one JSON object per event on stderr, through the standard logging module
and python-json-logger. Pass event fields with `extra={...}` (request_id, model, worker_id,
batch_size, queue_delay_ms, duration_ms)."""

from __future__ import annotations

import logging
import sys

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
