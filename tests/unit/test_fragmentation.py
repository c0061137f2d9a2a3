"""Fragmentation does not break the plan: an encoder-shaped model fed mixed text lengths from the
benchmark corpus keeps its reserved memory within its allocator cap, with and without expandable
segments (bench/fragmentation.py; `python -m bench.fragmentation` runs it for longer)."""

from __future__ import annotations

import pytest

from bench.fragmentation import run


@pytest.mark.parametrize("expandable", [False, True])
def test_mixed_lengths_keep_reserved_within_the_cap(expandable: bool) -> None:
    figures = run(expandable, forwards=300, seed=1)
    assert figures["oom_events"] == 0, figures
    assert 0 < figures["max_reserved_bytes"] <= figures["cap_bytes"], figures  # type: ignore[operator]
    assert figures["planned_batch_tokens"] < 32 * 64, figures  # the cap binds: full batches do not fit
