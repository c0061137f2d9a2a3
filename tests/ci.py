"""Real parts a test needs (Chromium, a Redis of a given version, a compose binary): on a
developer machine a missing one skips the test, in CI (CI=true, as GitHub Actions and .ci/run set)
it fails it, so that CI can never pass by skipping what it claims to test."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require_part(present: object, reason: str) -> None:
    """Skip (locally) or fail (CI=true) the calling test unless `present` is truthy."""
    if present:
        return
    if in_ci():
        pytest.fail(f"CI=true and a required part is missing: {reason}", pytrace=False)
    pytest.skip(reason)
