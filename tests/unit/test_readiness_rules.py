"""The readiness rule of gateway/observe/health.py applied to heartbeat fields (no Redis involved: the
rule reads the cached view only): fresh heartbeat, state=ready, healthy, recent success."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vramguard.gateway.observe.health import Health, HealthView
from vramguard.shared.clock import now_ms
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import Keys
from vramguard.shared.settings import Settings

NOW = 1_800_000_000_000


def health() -> Health:
    return Health(Settings(served_models=["synthetic"], heartbeat_ttl_ms=5000), None, Keys())  # type: ignore[arg-type]


def beat(**fields: object) -> WorkerBeat:
    """A heartbeat hash as a worker writes it (strings), parsed as the gateway parses it."""
    base = {"state": "ready", "healthy": "1", "last_ok_ms": str(NOW - 1000), "probe_interval_ms": "30000"}
    return WorkerBeat.from_hash({**base, **{k: str(v) for k, v in fields.items()}})


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({}, None),
        ({"last_ok_ms": NOW - 64_000}, None),  # within 2 x 30 s + 5 s
        ({"last_ok_ms": NOW - 66_000}, "last successful probe or batch 66.0 s ago"),
        ({"state": "warming"}, "state=warming"),
        ({"state": "unhealthy", "unhealthy_reason": "probe failed: CUDA error"},
         "state=unhealthy (probe failed: CUDA error)"),
        ({"healthy": "0"}, "no successful probe reported"),
        ({"last_ok_ms": "garbage"}, "last successful probe or batch"),
    ],
)
def test_worker_problem(fields: dict[str, object], problem: str | None) -> None:
    found = health().worker_problem(beat(**fields), NOW)
    assert found == problem if problem is None else problem in (found or "")


def test_a_worker_without_probe_fields_is_not_counted() -> None:
    """A worker that publishes no watchdog fields cannot prove it computes: not ready."""
    assert health().worker_problem(WorkerBeat.from_hash({"state": "ready"}), NOW) == "no successful probe reported"


def test_model_readiness_names_each_workers_problem() -> None:
    h = health()
    fresh = WorkerBeat(state="ready", healthy=True, last_ok_ms=now_ms(), probe_interval_ms=30000)
    h.view = HealthView(redis_ok=True, redis_error="", workers={"synthetic": {
        "a": replace(fresh, state="unhealthy", unhealthy_reason="3 consecutive batches failed")}})
    ok, details = h.model_readiness("synthetic")
    assert not ok and details["reasons"] == ["no live worker: a: state=unhealthy (3 consecutive batches failed)"]
    h.view.workers["synthetic"]["b"] = fresh
    ok, details = h.model_readiness("synthetic")
    assert ok and details["live_workers"] == 1 and details["heartbeats"] == 2
    assert h.readiness()[0] is True


def test_admission_sees_a_live_worker_go_stale_within_one_view() -> None:
    """The per-view cache of `has_live_worker` holds only until the freshest worker's last success
    ages past 2 probe intervals + the heartbeat TTL (65 s here), not for the view's life."""
    h = health()
    h.view = HealthView(redis_ok=True, redis_error="", workers={"synthetic": {"a": beat(), "b": beat(last_ok_ms=NOW)}})
    assert h.has_live_worker("synthetic", NOW)
    assert h.has_live_worker("synthetic", NOW + 65_000)  # b: 65 s since its success, at the limit
    assert not h.has_live_worker("synthetic", NOW + 65_001)
    assert not h.has_live_worker("other", NOW)


def test_admission_reads_a_replaced_view_at_once() -> None:
    h = health()
    h.view = HealthView(redis_ok=True, redis_error="", workers={"synthetic": {"a": beat()}})
    assert h.has_live_worker("synthetic", NOW)
    h.view = HealthView(redis_ok=True, redis_error="", workers={"synthetic": {"a": beat(state="unhealthy")}})
    assert not h.has_live_worker("synthetic", NOW)
    h.view = HealthView(redis_ok=True, redis_error="", workers={"synthetic": {"a": beat()}})
    assert h.has_live_worker("synthetic", NOW)
