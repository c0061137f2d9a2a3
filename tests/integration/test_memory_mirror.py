"""The allocation mirror (worker/memory/mirror.py) against the CPU's own measurement: for a real
model's batch, the peak memory the simulated GPU reserves is at least the peak of live tensor
bytes the CPU allocator had for the same batch (PyTorch's profiler, every allocation and free),
and within 2x of it. Weights count on both sides."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vramguard.shared.settings import Settings
from vramguard.worker.memory import mirror
from vramguard.worker.memory.simdevice import SimDevice
from vramguard.worker.models import create_backend

MIB = 1024 * 1024
# (model, items, tokens per item): a batch well inside each model's window.
BATCHES = [("minilm", 16, 128), ("smollm2", 4, 96)]


def cpu_peak_live_bytes(backend: object, batch: object, resident: int) -> int:
    """`resident` (the weights' bytes) plus the highest sum of the CPU allocator's allocations less
    its frees during one forward of `batch`, from the profiler's memory events (bytes)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        backend.forward(batch)  # type: ignore[attr-defined]
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += int(event.nbytes())
        peak = max(peak, live)
    return resident + peak


def storage_bytes(module: torch.nn.Module) -> int:
    """The bytes of the distinct storages of a module's parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*module.parameters(), *module.buffers()]}
    return sum(storages.values())


@pytest.fixture
def sim_device() -> Iterator[SimDevice]:
    device = SimDevice(8 * 1024 * MIB)
    mirror.install(device)
    yield device
    mirror.uninstall()


@pytest.mark.parametrize(("model", "items", "tokens"), BATCHES)
def test_the_simulated_peak_covers_the_cpu_peak_within_2x(model: str, items: int, tokens: int,
                                                          sim_device: SimDevice) -> None:
    """1. The model loads on the CPU; one batch runs under PyTorch's profiler (the CPU reference).
    2. Its weights are adopted into a large simulated GPU and the same batch runs mirrored.
    Result: simulated max_memory_reserved >= the CPU's peak of live tensor bytes, and <= 2x it."""
    settings = Settings(model=model, device="sim")
    backend = create_backend(settings, "sim")
    assert backend.device == "cpu"  # a real model on the simulated GPU computes on the CPU
    backend.load()
    module = backend.model if model == "minilm" else backend._model  # type: ignore[attr-defined]
    batch_items = [backend.sample_item(tokens) for _ in range(items)]
    backend.forward(backend.collate(batch_items))  # first-call allocations (caches, thread pools) out of the way
    cpu_peak = cpu_peak_live_bytes(backend, backend.collate(batch_items), storage_bytes(module))
    active = mirror.active()
    assert active is not None
    with active.scope():
        active.adopt_modules(backend)
        sim_device.reset_peak_memory_stats()
        backend.forward(backend.collate(batch_items))
    sim_peak = sim_device.max_memory_reserved()
    ratio = sim_peak / cpu_peak
    print(f"[mirror] {model} batch {items}x{tokens}: simulated peak reserved {sim_peak / MIB:.1f} MiB, "
          f"CPU peak live tensors {cpu_peak / MIB:.1f} MiB, ratio {ratio:.2f}")
    assert 1.0 <= ratio <= 2.0, (sim_peak, cpu_peak)
    assert sim_device.memory_allocated() < sim_peak  # the batch's tensors were freed when they died
