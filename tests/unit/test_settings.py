"""Settings: one object from the environment, typos and out-of-range values named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vramguard.shared.settings import Settings, SettingsError, check_env_names, settings_help


def test_defaults_are_valid() -> None:
    s = Settings()
    assert s.port == 8000 and s.served_models == ["minilm"]
    assert s.model_config_for("minilm").max_batch_size == 32


def test_unknown_variable_is_named() -> None:
    with pytest.raises(SettingsError, match="VRAMGUARD_MAX_BATCH"):
        check_env_names({"VRAMGUARD_MAX_BATCH": "8", "PATH": "/bin"})


def test_nested_model_variable_is_accepted() -> None:
    check_env_names({"VRAMGUARD_MODELS__MINILM__MAX_BATCH_SIZE": "8"})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"VRAMGUARD_PORT": "0"}, "VRAMGUARD_PORT"),
        ({"VRAMGUARD_PORT": "eighty"}, "VRAMGUARD_PORT"),
        ({"VRAMGUARD_DEVICE": "tpu"}, "VRAMGUARD_DEVICE"),
        ({"VRAMGUARD_MODEL": "gpt5"}, "unknown model"),
        ({"VRAMGUARD_MODELS__MINILM__MAX_BATCH_SIZE": "0"},
         "VRAMGUARD_MODELS__MINILM__MAX_BATCH_SIZE: .*greater than or equal to 1"),
        ({"VRAMGUARD_MODELS__MINILM__MAX_WAIT_MS": "50", "VRAMGUARD_MODELS__MINILM__DEFAULT_TIMEOUT_MS": "40"},
         "VRAMGUARD_MODELS__MINILM: .*must be below default_timeout_ms"),
        ({"VRAMGUARD_HEARTBEAT_TTL_MS": "500"}, "heartbeat_ttl_ms"),
        ({"VRAMGUARD_MODELS__MINILM__PAD_FACTOR": "0.5"}, "PAD_FACTOR: .*greater than or equal to 1"),
        # inf would be shown as null by /v1/models and as Infinity (not JSON) in the logs
        ({"VRAMGUARD_MODELS__MINILM__PAD_FACTOR": "inf"}, "PAD_FACTOR: Input should be a finite number"),
        ({"VRAMGUARD_SHUTDOWN_GRACE_S": "inf"}, "VRAMGUARD_SHUTDOWN_GRACE_S: Input should be a finite number"),
    ],
)
def test_invalid_values_stop_with_the_name(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=named):
        Settings.from_env()


def test_model_overrides_merge_with_catalogue_defaults() -> None:
    s = Settings(models={"synthetic": {"params": {"item_ms": 3.0}}, "minilm": {"max_wait_ms": 2}})  # type: ignore[dict-item]
    synthetic = s.model_config_for("synthetic")
    assert synthetic.params == {"batch_ms": 2.0, "item_ms": 3.0}
    assert s.model_config_for("minilm").max_wait_ms == 2
    assert s.model_config_for("minilm").max_batch_size == 32


def test_served_models_from_comma_separated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMGUARD_SERVED_MODELS", "minilm, synthetic")
    assert Settings.from_env().served_models == ["minilm", "synthetic"]


def test_api_key_is_masked() -> None:
    assert Settings(api_key="s3cret").masked()["api_key"] == "***"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"max_deliveries": 0}, "max_deliveries"),
        ({"claim_idle_ms": 2000, "reclaim_interval_ms": 1000}, "claim_idle_ms .* must be at least"),
        ({"claim_idle_ms": 2000, "heartbeat_interval_ms": 1000, "heartbeat_ttl_ms": 3000}, "claim_idle_ms"),
        ({"claim_idle_ms": 20_000, "consumer_idle_ms": 20_500}, "consumer_idle_ms must exceed"),
    ],
)
def test_delivery_settings_are_checked(values: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Settings(**values)  # type: ignore[arg-type]


def test_claim_idle_covers_the_batch_window() -> None:
    Settings(claim_idle_ms=3005, reclaim_interval_ms=1000, model="synthetic")  # 3 x 1000 + 5 ms window
    with pytest.raises(ValueError, match="claim_idle_ms"):
        Settings(claim_idle_ms=3004, reclaim_interval_ms=1000, model="synthetic")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:s3cret@redis.internal:6380/2?ssl_cert_reqs=none", "rediss://user:***@redis.internal:6380/2?ssl_cert_reqs=none"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_redis_password_is_masked(url: str, shown: str) -> None:
    masked = Settings(redis_url=url).masked()
    assert masked["redis_url"] == shown
    assert "s3cret" not in str(masked)


def test_max_inputs_per_request_defaults_to_256_and_must_be_positive() -> None:
    s = Settings(models={"synthetic": {"max_inputs_per_request": 8}})  # type: ignore[dict-item]
    assert s.model_config_for("minilm").max_inputs_per_request == 256
    assert s.model_config_for("synthetic").max_inputs_per_request == 8
    with pytest.raises(ValueError, match="MAX_INPUTS_PER_REQUEST"):
        Settings(models={"synthetic": {"max_inputs_per_request": 0}})  # type: ignore[dict-item]


@pytest.mark.parametrize("key", ["", " ", "\t"])
def test_blank_api_key_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    monkeypatch.setenv("VRAMGUARD_API_KEY", key)
    with pytest.raises(SettingsError, match="VRAMGUARD_API_KEY.*empty"):
        Settings.from_env()


def test_http_limits_have_safe_defaults() -> None:
    settings = Settings()
    assert settings.http_keep_alive_s > 60  # above common load-balancer idle timeouts (ALB, nginx: 60 s)
    assert settings.http_header_timeout_s <= 30 and settings.http_max_headers <= 200
    assert settings.http_max_header_bytes <= 64 * 1024


def test_help_lists_every_setting_under_the_name_it_is_read_from() -> None:
    text = settings_help()
    assert "  CUDA_VISIBLE_DEVICES " in text and "VRAMGUARD_CUDA_VISIBLE_DEVICES" not in text  # an alias, no prefix
    assert "  PROMETHEUS_MULTIPROC_DIR " in text
    assert "VRAMGUARD_MODELS__<MODEL>__PAD_FACTOR" in text and "VRAMGUARD_MODELS__<MODEL>__MAX_BATCH_SIZE" in text
    assert "VRAMGUARD_MODELS " not in text  # the nested table itself is not a variable
    assert "[minilm]" in text and "[[" not in text  # defaults as one would write them, not Python reprs
    for name in Settings.model_fields:
        if name not in {"models", "prometheus_multiproc_dir", "cuda_visible_devices"}:
            assert f"VRAMGUARD_{name.upper()} " in text, name


@pytest.mark.parametrize("module", ["vramguard.worker", "vramguard.gateway"])
def test_help_answers_without_starting_anything(module: str) -> None:
    """No Redis is running: a --help that started the process would fail or hang instead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                          env={**env, "VRAMGUARD_REDIS_URL": "redis://127.0.0.1:1/0"}, check=False)
    assert done.returncode == 0, done.stderr
    assert "VRAMGUARD_MODELS__<MODEL>__PAD_FACTOR" in done.stdout
    if module == "vramguard.worker":
        assert "2  INVALID_SETTINGS" in done.stdout and "8  FORWARD_HUNG" in done.stdout
