"""`ClusterCollector`: the workers' and queues' series, built at scrape time.

Worker series come from the heartbeat hashes cached in gateway/observe/health.py's HealthView, so a
worker whose heartbeat expired has no series at all (nothing frozen). Queue series come from
the `QueueStats` read just before rendering (gateway/observe/metrics.py). Names, labels and units:
shared/metrics.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vramguard.gateway.observe.health import Health
from vramguard.gateway.observe.queues import QueueStats, RedisMemory
from vramguard.shared import metrics as m
from vramguard.shared.heartbeat import WorkerBeat


class ClusterCollector(Collector):
    """Reads `health.view` and `queues` at each collect(); `queues` is set by the scrape."""

    def __init__(self, health: Health, models: list[str], queue_bounds: dict[str, int] | None = None) -> None:
        self._health = health
        self._models = models
        self._queue_bounds = queue_bounds or {}
        self.queues: dict[str, QueueStats] | None = None
        self.redis_memory: RedisMemory | None = None  # set by the scrape with `queues`

    def describe(self) -> list[Metric]:
        return []  # series vary with the live workers; never collect at registration

    def collect(self) -> Iterator[Metric]:
        yield from self._queue_families()
        beats = [beat for model in self._models for beat in self._health.view.workers.get(model, {}).values()]
        yield from self._worker_families(beats)

    def _queue_families(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(m.REDIS_UP, "1 when Redis answered the scrape's queue reads.")
        up.add_metric([], 1.0 if self.queues is not None else 0.0)
        yield up
        live = GaugeMetricFamily(m.LIVE_WORKERS, "Workers able to serve: fresh heartbeat, recent probe.",
                                 labels=[m.MODEL])
        for model in self._models:
            live.add_metric([model], float(len(self._health.live_workers(model))))
        yield live
        bound = GaugeMetricFamily(m.QUEUE_BOUND, "Requests queued or in flight at which admission answers 429.",
                                  labels=[m.MODEL])
        for model, value in self._queue_bounds.items():
            bound.add_metric([model], float(value))
        yield bound
        yield from self._redis_memory_families()
        if self.queues is None:
            return
        families = (
            (m.QUEUE_DEPTH, "Entries waiting for a worker (not yet delivered).", "waiting"),
            (m.PENDING_ENTRIES, "Entries delivered to a worker and not yet acked.", "pending"),
            (m.QUEUED_REQUESTS, "Requests queued or in flight (an entry may carry several): what queue_bound "
                                "bounds.", "requests"),
            (m.DEAD_LETTER_ENTRIES, "Entries in the dead-letter stream.", "dead_letters"),
        )
        for name, doc, attr in families:
            family = GaugeMetricFamily(name, doc, labels=[m.MODEL])
            for model, stats in self.queues.items():
                family.add_metric([model], float(getattr(stats, attr)))
            yield family

    def _redis_memory_families(self) -> Iterator[Metric]:
        memory = self.redis_memory
        if memory is None:
            return
        policy = GaugeMetricFamily(m.REDIS_MAXMEMORY_POLICY, "1, with Redis' maxmemory-policy as the label "
                                   "(anything but noeviction may evict queued requests).", labels=["policy"])
        policy.add_metric([memory.policy], 1.0)
        yield policy
        yield GaugeMetricFamily(m.REDIS_MEMORY_USED, "Memory Redis uses (INFO used_memory).", value=memory.used_bytes)
        yield GaugeMetricFamily(m.REDIS_MAXMEMORY, "Redis' maxmemory; 0 means no limit.", value=memory.maxmemory_bytes)

    def _worker_families(self, beats: list[WorkerBeat]) -> Iterator[Metric]:
        labels = list(m.WORKER_LABELS)
        info = GaugeMetricFamily(m.WORKER_INFO, "1 per live worker; state, pid and GPU UUID as labels.",
                                 labels=[*labels, "state", "pid", "gpu_uuid"])
        healthy = GaugeMetricFamily(m.WORKER_HEALTHY, "1 while the worker's watchdog reports healthy.", labels=labels)
        for beat in beats:
            key = m.worker_label_values(beat)
            info.add_metric([*key, beat.state, str(beat.pid), beat.gpu_uuid], 1.0)
            healthy.add_metric(key, 1.0 if beat.healthy else 0.0)
        yield info
        yield healthy
        for spec in (*m.WORKER_FIELDS, *m.plan_field_metrics()):
            yield from _field_family(spec, beats)
        yield from _histogram_families(beats)
        yield from _generation_families(beats)


def _field_family(spec: m.FieldMetric, beats: list[WorkerBeat]) -> Iterator[Metric]:
    """One family for `spec`, with a sample per worker that publishes the field; nothing when
    no worker does (e.g. memory fields before the memory budget runs)."""
    family: GaugeMetricFamily | CounterMetricFamily
    if spec.kind == "counter":
        family = CounterMetricFamily(spec.name, spec.help, labels=list(m.WORKER_LABELS))
    else:
        family = GaugeMetricFamily(spec.name, spec.help, labels=list(m.WORKER_LABELS))
    for beat in beats:
        value = getattr(beat, spec.field)
        if value is not None:
            family.add_metric(m.worker_label_values(beat), float(value) * spec.scale)
    if family.samples:
        yield family


def _histogram_families(beats: list[WorkerBeat]) -> Iterator[Metric]:
    decoded = [(beat, m.decode_histograms(beat.histograms)) for beat in beats]
    for short, (name, doc) in m.HISTOGRAMS.items():
        family = HistogramMetricFamily(name, doc, labels=list(m.WORKER_LABELS))
        for beat, snaps in decoded:
            snap = snaps.get(short)
            if snap is not None:
                buckets = [(floatToGoString(le), count) for le, count in snap.buckets]  # type: ignore[no-untyped-call]
                family.add_metric(m.worker_label_values(beat), buckets, snap.sum)
        if family.samples:
            yield family


# Generative workers' heartbeat `generation` JSON (worker/generate/server.py GenerationStats): name,
# kind, help, the JSON key, and the scale to the base unit (ms -> s).
GENERATION_SERIES = (
    ("generation_running_sequences", "gauge", "Sequences in the running batch (prefilling included).", "running", 1.0),
    ("generation_waiting_sequences", "gauge", "Sequences read and waiting for KV-cache room.", "waiting", 1.0),
    ("kv_cache_used_bytes", "gauge", "KV bytes of the tokens the sequences hold now.", "kv_bytes_used", 1.0),
    ("kv_cache_reserved_bytes", "gauge", "KV bytes of the blocks the sequences hold (last blocks whole).",
     "kv_bytes_reserved", 1.0),
    ("kv_cache_peak_bytes", "gauge", "The most bytes of blocks the sequences held at once since start.",
     "kv_bytes_peak", 1.0),
    ("generated_tokens", "counter", "Tokens generated.", "tokens_generated", 1.0),
    ("generation_finished", "counter", "Sequences that finished (stop or length).", "finished", 1.0),
    ("generation_cancelled", "counter", "Sequences stopped because their client left.", "cancelled", 1.0),
    ("generation_resumed", "counter", "Sequences resumed from a dead worker's progress.", "resumed", 1.0),
    ("generation_lost", "counter", "Sequences a worker stopped because another claimed their entry (it stalled).",
     "lost", 1.0),
    ("generation_preemptions", "counter", "Sequences preempted when the KV pool was full (blocks freed, "
     "tokens kept, prefilled again later).", "preemptions", 1.0),
    ("kv_cache_blocks", "gauge", "Blocks in the KV pool.", "kv_blocks_total", 1.0),
    ("kv_cache_used_blocks", "gauge", "KV pool blocks the sequences hold now (a shared block once).",
     "kv_blocks_used", 1.0),
    ("kv_cache_shared_blocks", "gauge", "KV pool blocks held by two sequences or more (prefix sharing).",
     "kv_blocks_shared", 1.0),
    ("kv_cache_held_tokens", "gauge", "Tokens the sequences hold in the KV pool now.", "kv_tokens_held", 1.0),
    ("kv_cache_prefix_hits", "counter", "Admissions that found their prompt's first blocks in the KV pool.",
     "prefix_hits", 1.0),
    ("kv_cache_prefix_hit_tokens", "counter", "Prompt tokens taken from shared blocks instead of computed.",
     "prefix_hit_tokens", 1.0),
    # Time to first token and per output token are histograms: the worker's heartbeat histograms.
)


def _generation_families(beats: list[WorkerBeat]) -> Iterator[Metric]:
    stats = [(beat, json.loads(beat.generation)) for beat in beats if beat.generation]
    if not stats:
        return
    plan = GaugeMetricFamily(m.PREFIX + "kv_cache_plan_bytes", "The KV pool's bytes, allocated once at start.",
                             labels=list(m.WORKER_LABELS))
    for beat, data in stats:
        plan.add_metric(m.worker_label_values(beat), float(data["kv_plan"]["kv_budget_bytes"]))
    yield plan
    for name, kind, doc, key, scale in GENERATION_SERIES:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(m.PREFIX + name, doc, labels=list(m.WORKER_LABELS))
        for beat, data in stats:
            family.add_metric(m.worker_label_values(beat), float(data.get(key, 0)) * scale)
        yield family
