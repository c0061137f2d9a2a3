"""shared/metrics.py and worker/metrics.py without Redis: the heartbeat's histogram format,
unit conversion, memory-plan field names, and throughput over the last minute."""

from __future__ import annotations

import math

import pytest

from vramguard.shared import metrics as m
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.worker.metrics import GpuUtilisation, WorkerMetrics


def test_histograms_survive_the_heartbeat_round_trip() -> None:
    wm = WorkerMetrics("cpu")
    wm.observe_batch(3, [1.0, 20.0, 2500.0], 12.0)  # ms in, seconds out
    wm.observe_batch(1, [4.0], 2.0)
    decoded = m.decode_histograms(m.encode_histograms(wm.snapshots()))
    assert set(decoded) == set(m.HISTOGRAMS) - {"time_to_first_token_seconds", "time_per_output_token_seconds"}
    size = decoded["batch_size"]
    assert size.count == 2 and size.sum == 4
    assert dict(size.buckets)[1.0] == 1 and dict(size.buckets)[4.0] == 2 and size.buckets[-1][0] == math.inf
    delay = decoded["queue_delay_seconds"]
    assert delay.count == 4 and delay.sum == pytest.approx(2.525)
    assert decoded["forward_duration_seconds"].sum == pytest.approx(0.014)
    assert "time_to_first_token_seconds" not in decoded  # a batch model's worker keeps no token latencies


def test_a_generative_workers_token_latencies_are_histograms() -> None:
    wm = WorkerMetrics("cpu", generates=True)
    wm.observe_first_token(30.0)  # ms in, seconds out
    wm.observe_first_token(1500.0)
    wm.observe_finished(40.0)
    decoded = m.decode_histograms(m.encode_histograms(wm.snapshots()))
    ttft, tpot = decoded["time_to_first_token_seconds"], decoded["time_per_output_token_seconds"]
    assert ttft.count == 2 and ttft.sum == pytest.approx(1.53) and dict(ttft.buckets)[0.05] == 1
    assert tpot.count == 1 and dict(tpot.buckets)[0.035] == 0 and dict(tpot.buckets)[0.05] == 1


def test_no_forward_means_no_forward_duration_sample() -> None:
    wm = WorkerMetrics("cpu")
    wm.observe_batch(0, [], None)  # every entry had expired
    snaps = wm.snapshots()
    assert snaps["forward_duration_seconds"].count == 0 and snaps["batch_size"].count == 0


@pytest.mark.parametrize("field", [
    "", "not json", "[1, 2]", '{"batch_size": {"buckets": [[1, 2]], "sum": 1}}',  # no +Inf bucket
    '{"batch_size": {"buckets": [[1, 5], ["+Inf", 2]], "sum": 1}}',  # not cumulative
    '{"batch_size": {"buckets": "x"}}', '{"batch_size": {"buckets": [["a", 1]]}}',
])
def test_malformed_histogram_fields_are_skipped(field: str) -> None:
    assert m.decode_histograms(field) == {}


def test_unknown_histograms_are_ignored() -> None:
    field = '{"other": {"buckets": [["+Inf", 1]], "sum": 1}, "batch_size": {"buckets": [["+Inf", 2]], "sum": 3}}'
    assert list(m.decode_histograms(field)) == ["batch_size"]


def test_every_plan_field_of_the_heartbeat_is_a_gauge_with_its_unit() -> None:
    specs = {spec.field: spec for spec in m.plan_field_metrics()}
    assert specs["plan_per_item_bytes"].name == "vramguard_worker_plan_per_item_bytes"
    assert specs["plan_batch_size"].kind == "gauge" and "plan_inflight_batches" in specs
    assert all(name.startswith("plan_") for name in specs)


def test_every_exported_name_has_the_prefix_and_a_base_unit() -> None:
    for spec in m.WORKER_FIELDS:
        assert spec.name.startswith("vramguard_")
        assert not spec.name.endswith(("_ms", "_percent", "_total")), spec.name
        if spec.field.endswith("_ms"):
            assert spec.name.endswith("_seconds") and spec.scale == 1e-3


def test_worker_labels_name_the_gpu_and_the_device_kind() -> None:
    beat = WorkerBeat(model="minilm", worker_id="h-minilm-gpu1-0", device="cuda", device_kind="cuda", gpu="1")
    assert m.worker_label_values(beat) == ["minilm", "h-minilm-gpu1-0", "cuda", "1"]
    assert WorkerBeat(device="cuda:1").device_label == "cuda"  # before the memory budget reports its kind
    assert WorkerBeat(device="cpu", device_kind="sim").device_label == "sim"


def test_throughput_covers_the_last_minute() -> None:
    now = [0.0]
    wm = WorkerMetrics("cpu", clock=lambda: now[0])
    assert wm.throughput(0, 0) == (0.0, 0.0)
    now[0] = 10.0
    assert wm.throughput(100, 10) == (10.0, 10.0)
    for t in range(20, 121, 10):  # 10 items/s for 2 minutes, then idle for 70 s
        now[0] = float(t)
        wm.throughput(t * 10, t)
    now[0] = 190.0
    per_s, mean = wm.throughput(1200, 120)
    assert per_s == pytest.approx(0.0) and mean == 0.0
    now[0] = 200.0
    per_s, mean = wm.throughput(1800, 130)  # 600 items in 10 batches since the oldest kept sample (120 s)
    assert per_s == pytest.approx(600 / 80) and mean == pytest.approx(60.0)


def test_gpu_utilisation_is_absent_off_cuda() -> None:
    assert GpuUtilisation("cpu").percent() is None
    assert "gpu_utilization_percent" not in WorkerMetrics("cpu").heartbeat_fields(0, 0)


def test_gpu_utilisation_without_nvml_is_dropped_not_fatal() -> None:
    """On a machine without a GPU, a CUDA worker's NVML read fails: logged once, then not reported."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; tests/gpu covers the real reading")
    gpu = GpuUtilisation("cuda")
    assert gpu.percent() is None and gpu.percent() is None
