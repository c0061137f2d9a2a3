"""Cost-based batching: the entries of one read are grouped into forwards by their
padded cost, cheapest first, so that one long input is not padded together with many short
ones. Pure arithmetic; the runner serves and publishes each group in turn."""

from __future__ import annotations

from collections.abc import Sequence


def group_by_cost(
    entry_costs: Sequence[Sequence[int]], max_batch_size: int, max_batch_cost: int | None, pad_factor: float
) -> list[list[int]]:
    """Partition entries, each given as its items' costs, into groups of entry indices.

    Length bucketing as fairseq's `batch_by_size` and tf.data's `bucket_by_sequence_length` do:
    entries are taken cheapest first (by their costliest item); a group closes when the next
    entry would take it past `max_batch_size` items, past `max_batch_cost` (padded cost =
    items x costliest item; None: no limit), or past `pad_factor` x its real cost (the sum of
    item costs; ModelConfig.pad_factor says why its default is 4). An entry is never split here
    (its items share one reply); execute.run_batch chunks an oversized one. Fixed-size items
    (cost 1) are never separated by padding, only by the two limits.

    Returns the groups in serving order; every index appears once.
    """
    order = sorted(range(len(entry_costs)), key=lambda i: max(entry_costs[i], default=0))
    groups: list[list[int]] = []
    current: list[int] = []
    items = largest = real = 0
    for i in order:
        costs = entry_costs[i]
        top, total = max(costs, default=0), sum(costs)
        if current:
            padded = (items + len(costs)) * max(largest, top)
            if (items + len(costs) > max_batch_size
                    or (max_batch_cost is not None and padded > max_batch_cost)
                    or padded > pad_factor * (real + total)):
                groups.append(current)
                current, items, largest, real = [], 0, 0, 0
        current.append(i)
        items, largest, real = items + len(costs), max(largest, top), real + total
    if current:
        groups.append(current)
    return groups
