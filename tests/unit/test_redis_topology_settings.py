"""Key layout for Redis Cluster and the Redis topology settings: every key one script or MULTI
touches shares a hash slot, models and gateways spread over slots, and bad topology settings
fail at start naming the variable."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from vramguard.shared.keys import Keys, hash_tag
from vramguard.shared.settings import Settings, SettingsError, check_env_names


def slot(key: str) -> int:
    return key_slot(key.encode())  # redis-py applies the {...} rule itself


def test_a_models_keys_share_one_slot_and_models_and_gateways_differ() -> None:
    keys = Keys("vg")
    for model in ("minilm", "synthetic"):
        # The dead-letter MULTI (request + dead-letter stream) and the worker index stay in one slot.
        # So do the admission script's and the ack MULTI's queue depth counter.
        assert slot(keys.request_stream(model)) == slot(keys.dead_letter_stream(model)) == slot(
            keys.worker_index(model)) == slot(keys.queued_requests(model)) == key_slot(model.encode())
    assert slot(keys.request_stream("minilm")) != slot(keys.request_stream("synthetic"))
    assert slot(keys.reply_stream("gw1")) == key_slot(b"gw1")
    assert hash_tag(keys.heartbeat("host-1")) == "host-1"
    assert hash_tag("no-tag") == "no-tag" and hash_tag("a{}b") == "a{}b"


def test_sentinel_list_is_parsed_and_checked() -> None:
    settings = Settings(redis_sentinels="10.0.0.1:26379, s2:26379")  # type: ignore[arg-type]
    assert settings.redis_sentinels == ["10.0.0.1:26379", "s2:26379"]
    with pytest.raises(ValueError, match="not host:port"):
        Settings(redis_sentinels="s1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exclude each other"):
        Settings(redis_sentinels="s1:26379", redis_cluster=True)  # type: ignore[arg-type]


def test_sentinel_password_is_masked_and_topology_names_are_known() -> None:
    settings = Settings(redis_sentinels="s1:26379", redis_sentinel_password="hunter2")  # type: ignore[arg-type]
    assert "hunter2" not in str(settings.masked())
    check_env_names({"VRAMGUARD_REDIS_SENTINELS": "s1:1", "VRAMGUARD_REDIS_CLUSTER": "true",
                     "VRAMGUARD_REDIS_SENTINEL_MASTER": "m", "VRAMGUARD_REDIS_EVICTION_CHECK": "refuse"})
    with pytest.raises(SettingsError, match="unknown setting VRAMGUARD_REDIS_SENTINEL;"):
        check_env_names({"VRAMGUARD_REDIS_SENTINEL": "s1:1"})
