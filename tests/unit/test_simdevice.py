"""The simulated device follows the CUDA caching allocator's rules (worker/memory/simalloc.py,
worker/memory/simdevice.py; c10/cuda/CUDACachingAllocator.cpp): one test per rule."""

from __future__ import annotations

import pytest
import torch

from vramguard.worker.memory.simalloc import round_size, segment_size
from vramguard.worker.memory.simdevice import MIB, SimDevice

KIB = 1024


def test_requests_are_rounded_to_512_bytes() -> None:
    assert [round_size(n) for n in (0, 1, 512, 513, 1000, 1025)] == [512, 512, 512, 1024, 1024, 1536]
    dev = SimDevice(100 * MIB)
    dev.allocate(1000)
    assert dev.memory_allocated() == 1024


def test_small_requests_share_2_mib_segments_of_the_small_pool() -> None:
    assert segment_size(1 * MIB) == 2 * MIB
    dev = SimDevice(100 * MIB)
    first = dev.allocate(512 * KIB)
    dev.allocate(512 * KIB)
    assert dev.memory_reserved() == 2 * MIB and dev.memory_allocated() == 1 * MIB
    dev.allocate(1 * MIB)  # the rest of that segment
    assert dev.memory_reserved() == 2 * MIB
    dev.allocate(512)  # full: a second small segment
    assert dev.memory_reserved() == 4 * MIB
    dev.release(first)
    assert dev.memory_reserved() == 4 * MIB  # cached, not returned


def test_large_requests_under_10_mib_take_a_20_mib_segment_above_it_rounded_to_2_mib() -> None:
    assert segment_size(1 * MIB + 512) == 20 * MIB
    assert segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(11 * MIB) == 12 * MIB
    dev = SimDevice(100 * MIB)
    dev.allocate(3 * MIB)
    assert dev.memory_reserved() == 20 * MIB and dev.memory_allocated() == 3 * MIB
    dev.allocate(15 * MIB)  # the 17 MiB left of that segment hold it (best fit, split)
    assert dev.memory_reserved() == 20 * MIB
    dev.allocate(11 * MIB)
    assert dev.memory_reserved() == 32 * MIB


def test_a_block_whose_rest_is_at_most_1_mib_is_not_split_and_counts_whole() -> None:
    dev = SimDevice(100 * MIB)
    block = dev.allocate(12 * MIB)
    dev.release(block)
    dev.allocate(11 * MIB + 512)  # rest 512 KiB - 512 B <= 1 MiB: the whole 12 MiB block is handed out
    assert dev.memory_allocated() == 12 * MIB and dev.memory_reserved() == 12 * MIB


def test_freed_segments_stay_reserved_until_empty_cache() -> None:
    dev = SimDevice(100 * MIB)
    weights = dev.allocate(40 * MIB)
    with dev.transient(30 * MIB):
        assert dev.memory_allocated() == 70 * MIB
    assert dev.memory_allocated() == 40 * MIB
    assert dev.memory_reserved() == 70 * MIB
    assert dev.max_memory_allocated() == 70 * MIB
    dev.empty_cache()
    dev.reset_peak_memory_stats()
    assert dev.memory_reserved() == 40 * MIB and dev.max_memory_allocated() == 40 * MIB
    assert dev.max_memory_reserved() == 40 * MIB
    dev.release(weights)
    dev.empty_cache()
    assert dev.memory_reserved() == 0


def test_the_fraction_is_checked_only_when_a_new_segment_is_taken() -> None:
    """The cap set after memory was reserved does not give it back; cached blocks are reused
    under it; only a new segment past it fails (with the allocator's own cache released first)."""
    dev = SimDevice(100 * MIB)
    with dev.transient(60 * MIB):
        pass
    dev.set_per_process_memory_fraction(0.3)
    assert dev.memory_reserved() == 60 * MIB  # above the 30 MiB cap, and it stays
    with dev.transient(50 * MIB):  # a cached block holds it: no check
        assert dev.memory_reserved() == 60 * MIB
    dev.allocate(25 * MIB)  # splits the cached block: still no new segment
    assert dev.memory_reserved() == 60 * MIB
    with pytest.raises(torch.cuda.OutOfMemoryError, match="a limit of 30.00 MiB for this process's allocator"):
        dev.allocate(40 * MIB)  # needs a segment; the live 25 MiB keep the 60 MiB one from release
    assert dev.memory_allocated() == 25 * MIB  # a failed allocation takes nothing


def test_a_new_segment_past_the_cap_releases_the_cache_and_retries() -> None:
    dev = SimDevice(100 * MIB)
    dev.set_per_process_memory_fraction(0.5)
    with dev.transient(30 * MIB):
        pass
    dev.allocate(40 * MIB)  # 30 cached + 40 > 50: the cached segment goes back first, then it fits
    assert dev.memory_reserved() == 40 * MIB
    with pytest.raises(ValueError):
        dev.set_per_process_memory_fraction(1.5)


def test_fragmentation_a_large_block_no_cached_segment_holds_takes_a_new_one() -> None:
    dev = SimDevice(200 * MIB)
    blocks = [dev.allocate(30 * MIB) for _ in range(3)]
    dev.release(blocks[0])
    dev.release(blocks[2])
    assert dev.memory_allocated() == 30 * MIB and dev.memory_reserved() == 90 * MIB
    dev.allocate(50 * MIB)  # 60 MiB are free, but in two 30 MiB segments
    assert dev.memory_reserved() == 140 * MIB


def test_context_and_modules_are_outside_the_allocator_but_in_device_used_memory() -> None:
    dev = SimDevice(100 * MIB, context_bytes=10 * MIB, module_bytes=5 * MIB)
    assert dev.outside_bytes == 10 * MIB and dev.mem_get_info() == (90 * MIB, 100 * MIB)
    with dev.transient(20 * MIB):  # the first kernel launch loads the modules (lazy loading)
        pass
    assert dev.memory_reserved() == 20 * MIB  # never counts the context or the modules
    assert dev.outside_bytes == 15 * MIB and dev.mem_get_info() == (65 * MIB, 100 * MIB)
    assert [p.used_bytes for p in dev.processes()] == [35 * MIB]


def test_the_device_total_binds_the_allocator_with_the_context_counted() -> None:
    dev = SimDevice(100 * MIB, context_bytes=30 * MIB)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 80.00 MiB"):
        dev.allocate(80 * MIB)  # the fraction (1.0) allows it, the device does not
    dev.allocate(70 * MIB)


def test_expandable_segments_grow_one_segment_instead_of_taking_new_ones() -> None:
    """The fragmentation case above with expandable segments: the second request extends the free
    tail of the one segment; empty_cache unmaps the free pages at its end."""
    plain, grown = SimDevice(400 * MIB), SimDevice(400 * MIB, expandable_segments=True)
    for dev in (plain, grown):
        first = dev.allocate(30 * MIB)
        second = dev.allocate(30 * MIB)
        dev.release(second)
        dev.allocate(50 * MIB)
        dev.release(first)
    assert plain.memory_reserved() == 110 * MIB
    assert grown.memory_reserved() == 80 * MIB  # 20 MiB pages: 40 for the first two, 40 more for the 50
    grown.empty_cache()
    assert grown.memory_reserved() == 80 * MIB  # the live 50 MiB sit at the end: nothing to unmap
    plain.empty_cache()
    assert plain.memory_reserved() == 50 * MIB


def test_older_callers_release_by_size() -> None:
    dev = SimDevice(100 * MIB)
    dev.allocate(8 * MIB)
    dev.allocate(8 * MIB)
    dev.release(8 * MIB)
    assert dev.memory_allocated() == 8 * MIB
    with pytest.raises(ValueError, match="no live block of 3 bytes"):
        dev.release(3)


def test_expandable_segments_check_the_whole_request_against_the_fraction() -> None:
    """PyTorch's rule (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::alloc_block): with
    a fraction set, `total_allocated_memory + p.alloc_size > allowed_memory_maximum` refuses before
    try_allocate_expandable_block maps any page, alloc_size being the request's whole segment size
    (get_allocation_size), not the pages still to map.
    1. A 200 MiB device capped at 70 MiB with expandable segments holds 25 MiB: two 20 MiB pages
       mapped (40 MiB), a free tail of 15 MiB.
    2. A request of 32 MiB needs one more page only (60 MiB <= 70), but 40 + 32 > 70.
       Result: refused, as PyTorch refuses it, and nothing is mapped.
    3. The tail is filled; the cap lowered to 55 MiB; a request of 12 MiB passes (40 + 12 <= 55)
       and maps a whole page. Result: 60 MiB reserved, over the cap by less than a page, as on CUDA."""
    dev = SimDevice(200 * MIB, expandable_segments=True)
    dev.set_per_process_memory_fraction(70 / 200)
    dev.allocate(25 * MIB)
    assert dev.memory_reserved() == 40 * MIB
    with pytest.raises(torch.cuda.OutOfMemoryError, match="a limit of 70.00 MiB"):
        dev.allocate(32 * MIB)
    assert dev.memory_reserved() == 40 * MIB
    dev.allocate(15 * MIB)
    dev.set_per_process_memory_fraction(55 / 200)
    dev.allocate(12 * MIB)
    assert dev.memory_reserved() == 60 * MIB
