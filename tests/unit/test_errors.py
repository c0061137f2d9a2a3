"""Every error code of shared/errors.py's table maps to its HTTP status."""

from __future__ import annotations

from vramguard.shared.errors import ModelError, QueueFullError, all_error_classes, error_from_code

DESIGN_TABLE = {
    "invalid_input": 422,
    "unauthorized": 401,
    "model_not_found": 404,
    "payload_too_large": 413,
    "input_too_large": 413,
    "input_too_long": 413,
    "context_length_exceeded": 400,
    "unsupported_media_type": 415,
    "queue_full": 429,
    "model_error": 500,
    "unavailable": 503,
    "deadline_exceeded": 504,
    "internal": 500,
}


def test_codes_and_statuses_match_design() -> None:
    assert {code: cls.http_status for code, cls in all_error_classes().items()} == DESIGN_TABLE


def test_error_from_code_rebuilds_the_class_and_unknown_becomes_model_error() -> None:
    err = error_from_code("queue_full", "busy", request_id="r")
    assert isinstance(err, QueueFullError) and err.request_id == "r" and err.message == "busy"
    assert isinstance(error_from_code("no_such_code", "x"), ModelError)
