"""Worker-side metrics: batch size, queue delay and forward duration histograms,
throughput over the last minute and GPU utilisation, published as heartbeat fields.

The histograms are prometheus_client Histograms in a private registry (the library does the
bucketing); `heartbeat_fields` snapshots them into one JSON field that the gateway exposes at
scrape time (shared/metrics.py defines names, buckets and the snapshot format). Never touches
Redis; torch is imported only for NVML utilisation on CUDA workers.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Histogram

from vramguard.shared import metrics as m
from vramguard.shared.heartbeat import HISTOGRAM_FIELD

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 60.0


class WorkerMetrics:
    """Observations of one worker process. Call `observe_batch` after each batch and
    `heartbeat_fields` at each heartbeat (both from the event loop)."""

    def __init__(self, device: str, clock: Callable[[], float] = time.monotonic, *, generates: bool = False) -> None:
        """`generates`: a generative model's worker also keeps the token latency histograms."""
        self._registry = CollectorRegistry()
        self._batch_size = Histogram("batch_size", "items per batch", buckets=m.BATCH_SIZE_BUCKETS,
                                     registry=self._registry)
        self._queue_delay = Histogram("queue_delay_seconds", "enqueue to batch start",
                                      buckets=m.QUEUE_DELAY_BUCKETS_S, registry=self._registry)
        self._forward = Histogram("forward_duration_seconds", "run_batch duration",
                                  buckets=m.FORWARD_DURATION_BUCKETS_S, registry=self._registry)
        self._ttft: Histogram | None = None
        self._tpot: Histogram | None = None
        if generates:
            self._ttft = Histogram("time_to_first_token_seconds", "admission to first token",
                                   buckets=m.TTFT_BUCKETS_S, registry=self._registry)
            self._tpot = Histogram("time_per_output_token_seconds", "mean time per token after the first",
                                   buckets=m.TPOT_BUCKETS_S, registry=self._registry)
        self._clock = clock
        self._window: deque[tuple[float, int, int]] = deque()  # (monotonic s, items, batches) per beat
        self._gpu = GpuUtilisation(device)

    def observe_batch(self, batch_size: int, queue_delays_ms: Sequence[float], duration_ms: float | None) -> None:
        """Record one batch: its items, each request's queue delay (ms) and the forward time (ms;
        None when no forward ran, e.g. every entry had expired)."""
        if batch_size:
            self._batch_size.observe(batch_size)
        for delay_ms in queue_delays_ms:
            self._queue_delay.observe(m.ms_to_s(max(0.0, delay_ms)))
        if duration_ms is not None:
            self._forward.observe(m.ms_to_s(duration_ms))

    def observe_first_token(self, ttft_ms: float) -> None:
        """A sequence's time to first token (ms, admission to its first chunk)."""
        if self._ttft is not None:
            self._ttft.observe(m.ms_to_s(max(0.0, ttft_ms)))

    def observe_finished(self, tpot_ms: float) -> None:
        """A finished sequence's mean time per output token after the first (ms)."""
        if self._tpot is not None:
            self._tpot.observe(m.ms_to_s(max(0.0, tpot_ms)))

    def snapshots(self) -> dict[str, m.HistogramSnapshot]:
        """The histograms now, keyed by their short names in shared.metrics.HISTOGRAMS."""
        out = {}
        for family in self._registry.collect():
            buckets = tuple((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
            total = next((s.value for s in family.samples if s.name.endswith("_sum")), 0.0)
            out[family.name] = m.HistogramSnapshot(buckets=buckets, sum=total)
        return out

    def throughput(self, items: int, batches: int) -> tuple[float, float]:
        """(items per second, mean items per batch) over the last minute, from the cumulative
        counters at each call; the first minute uses the time since the first call."""
        now = self._clock()
        self._window.append((now, items, batches))
        while len(self._window) > 2 and now - self._window[1][0] >= THROUGHPUT_WINDOW_S:
            self._window.popleft()
        t0, items0, batches0 = self._window[0]
        elapsed = now - t0
        per_s = (items - items0) / elapsed if elapsed > 0 else 0.0
        mean = (items - items0) / (batches - batches0) if batches > batches0 else 0.0
        return per_s, mean

    def heartbeat_fields(self, items: int, batches: int) -> dict[str, object]:
        """Fields for the heartbeat hash: histograms, throughput and, on CUDA, GPU utilisation."""
        per_s, mean = self.throughput(items, batches)
        fields: dict[str, object] = {
            HISTOGRAM_FIELD: m.encode_histograms(self.snapshots()),
            "items_per_s": round(per_s, 3),
            "mean_batch_size_1m": round(mean, 3),
        }
        util = self._gpu.percent()
        if util is not None:
            fields["gpu_utilization_percent"] = util
        return fields


class GpuUtilisation:
    """NVML utilisation of this worker's GPU through torch.cuda.utilization (which uses the
    nvidia-ml-py package and maps CUDA_VISIBLE_DEVICES). None on CPU or simulated devices, or
    when NVML is unavailable (then logged once)."""

    def __init__(self, device: str) -> None:
        self._device = device
        self._enabled = device.startswith("cuda")

    def percent(self) -> float | None:
        if not self._enabled:
            return None
        try:
            import torch

            value = float(torch.cuda.utilization(self._device))
        except Exception as exc:  # noqa: BLE001 - NVML missing or failing must not stop the heartbeat
            log.warning("GPU utilisation unavailable; not reported", extra={"error": repr(exc)})
            self._enabled = False
            return None
        return value if math.isfinite(value) else None
