"""NVML utilisation on a real GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_cuda_worker_reports_gpu_utilisation() -> None:
    from vramguard.worker.metrics import GpuUtilisation, WorkerMetrics

    assert 0 <= (GpuUtilisation("cuda:0").percent() or -1) <= 100
    assert "gpu_utilization_percent" in WorkerMetrics("cuda:0").heartbeat_fields(0, 0)
