"""The heartbeat schema (shared/heartbeat.py): what a worker writes is what every reader parses,
typed; a worker of another version (fields missing, unknown or malformed) never breaks a reader."""

from __future__ import annotations

from vramguard.shared.heartbeat import WorkerBeat, beat_field_names


def test_a_beat_survives_the_redis_hash_with_its_types() -> None:
    beat = WorkerBeat(worker_id="h-synthetic-gpu0-1", model="synthetic", pid=42, gpu="0", gpu_uuid="SIM-0",
                      memory_share=0.2, healthy=True, batches=7, queue_delay_ms_sum=12.5, mem_budget_bytes=1 << 30,
                      plan_batch_size=33, plan_per_token_bytes=52428.8)
    raw = {k.encode(): v.encode() for k, v in beat.to_hash().items()}  # as HGETALL returns it
    assert WorkerBeat.from_hash(raw) == beat


def test_unset_optional_numbers_are_not_written_and_read_back_as_none() -> None:
    written = WorkerBeat(worker_id="w").to_hash()
    assert "mem_budget_bytes" not in written and "gpu_utilization_percent" not in written
    assert WorkerBeat.from_hash(written).mem_budget_bytes is None


def test_unknown_missing_and_malformed_fields_take_defaults() -> None:
    beat = WorkerBeat.from_hash({"state": "ready", "batches": "many", "pid": "nan", "from_the_future": "1",
                                 "items": "3", "healthy": "1", "memory_share": ""})
    assert beat.state == "ready" and beat.batches == 0 and beat.pid == 0 and beat.items == 3
    assert beat.healthy is True and beat.memory_share is None


def test_json_form_has_numbers_not_strings_and_no_histograms_unless_asked() -> None:
    data = WorkerBeat.from_hash({"requests": "200", "oom_events": "0", "histograms": "{}"}).as_json()
    assert data["requests"] == 200 and data["oom_events"] == 0 and "histograms" not in data
    assert set(data) == set(beat_field_names()) - {"histograms"}


def test_json_form_has_the_generation_stats_as_an_object() -> None:
    generating = WorkerBeat(worker_id="w", generation='{"running": 2, "kv_plan": {"tokens_fit": 10}}').as_json()
    assert generating["generation"] == {"running": 2, "kv_plan": {"tokens_fit": 10}}
    assert WorkerBeat(worker_id="w").as_json()["generation"] is None  # a model that does not generate
    assert WorkerBeat(worker_id="w", generation="{broken").as_json()["generation"] is None
