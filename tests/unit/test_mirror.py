"""The allocation mirror's rules (worker/memory/mirror.py): each new storage is one allocation of
its size, in order; a view or an in-place result is none; a storage's death frees its block; the
CUDA-only workspaces are added beside the outputs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from vramguard.worker.memory import mirror
from vramguard.worker.memory.mirror import CUBLAS_WORKSPACE_BYTES
from vramguard.worker.memory.simdevice import SimDevice

MIB = 1024 * 1024


@pytest.fixture
def device() -> Iterator[SimDevice]:
    dev = SimDevice(1024 * MIB)
    mirror.install(dev)
    yield dev
    mirror.uninstall()


def test_new_storages_are_allocated_and_their_death_frees_them(device: SimDevice) -> None:
    with mirror.scope():
        a = torch.zeros(1024, 1024)  # 4 MiB
        view = a[:10]
        a.add_(1)  # in place: the same storage
        b = a * 2
    assert device.memory_allocated() == 8 * MIB
    del a, view
    assert device.memory_allocated() == 4 * MIB  # a's storage died with its last view
    del b
    assert device.memory_allocated() == 0
    assert device.memory_reserved() == 20 * MIB and device.max_memory_allocated() == 8 * MIB  # one cached segment


def test_a_matrix_product_takes_the_cublas_workspace_once_and_attention_its_math_path(device: SimDevice) -> None:
    """cuBLAS's workspace is taken at the first product and kept; scaled dot-product attention holds
    2 x B x H x L x S x element size beside its output for the op (the math path's scores and probabilities)."""
    x = torch.ones(64, 64)
    with mirror.scope():
        y = x @ x
        z = y @ y
    assert device.memory_allocated() == CUBLAS_WORKSPACE_BYTES + 2 * 64 * 64 * 4
    del y, z
    q = torch.zeros(2, 4, 256, 32)
    device.reset_peak_memory_stats()
    with mirror.scope():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    scores = 2 * 2 * 4 * 256 * 256 * 4
    assert device.max_memory_allocated() >= CUBLAS_WORKSPACE_BYTES + out.untyped_storage().nbytes() + scores
    assert device.memory_allocated() < CUBLAS_WORKSPACE_BYTES + out.untyped_storage().nbytes() + scores


def test_an_allocation_the_simulated_gpu_refuses_raises_its_oom_in_the_model(device: SimDevice) -> None:
    device.set_per_process_memory_fraction(0.05)  # 51 MiB
    with mirror.scope(), pytest.raises(torch.cuda.OutOfMemoryError, match="simulated device"):
        torch.zeros(16 * 1024 * 1024)  # 64 MiB


def test_weights_made_outside_the_mirror_are_adopted_where_they_live(device: SimDevice) -> None:
    layer = torch.nn.Linear(512, 512)  # made before any mirror saw it, as a loader's tensors are
    holder = {"model": [layer]}  # as a backend holds its model, however deep
    adopted = mirror.active().adopt_modules(holder)  # type: ignore[union-attr]
    assert adopted == 512 * 512 * 4 + 512 * 4
    assert mirror.active().adopt_modules(holder) == 0  # type: ignore[union-attr]
    del layer
