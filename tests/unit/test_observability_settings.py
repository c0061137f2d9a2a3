"""The observability settings: defaults, ranges, and the probe fault guarded by
fault injection, each refused with the variable named."""

from __future__ import annotations

import pytest

from vramguard.shared.settings import Settings, SettingsError


def test_defaults() -> None:
    s = Settings()
    assert s.probe_interval_s == 30 and s.max_consecutive_failed_batches == 5 and s.probe_fault == "none"
    assert s.access_log is False


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"VRAMGUARD_PROBE_INTERVAL_S": "0"}, "VRAMGUARD_PROBE_INTERVAL_S"),
        ({"VRAMGUARD_MAX_CONSECUTIVE_FAILED_BATCHES": "0"}, "VRAMGUARD_MAX_CONSECUTIVE_FAILED_BATCHES"),
        ({"VRAMGUARD_PROBE_FAULT": "meteor"}, "VRAMGUARD_PROBE_FAULT"),
        ({"VRAMGUARD_PROBE_FAULT": "cuda_error"}, "probe_fault needs fault_injection"),
    ],
)
def test_invalid_values_stop_with_the_name(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=named):
        Settings.from_env()


def test_probe_fault_with_fault_injection_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMGUARD_PROBE_FAULT", "cuda_error")
    monkeypatch.setenv("VRAMGUARD_FAULT_INJECTION", "true")
    assert Settings.from_env().probe_fault == "cuda_error"
