"""A request whose deadline passes while an earlier cost group of the same read runs is
answered `deadline_exceeded` without a forward: no compute is spent on a caller who has
already been answered 504."""

from __future__ import annotations

import asyncio

from tests.helpers import wait_until


async def test_expired_entry_of_a_later_group_costs_no_forward(gateway, start_worker) -> None:
    # Cost = word count (max_tokens 256); every forward sleeps 800 ms whatever its size, so the
    # long text's group, which runs after the short one's, starts after its 400 ms deadline.
    handle = await start_worker(model="synthetic", models={"synthetic": {
        "max_wait_ms": 300, "params": {"batch_ms": 800, "item_ms": 0, "max_tokens": 256}}})

    async def live() -> bool:
        return (await gateway.get("/v1/models/synthetic")).json()["live_workers"] == 1

    await wait_until(live, 10)
    warm = await gateway.post("/v1/models/synthetic/infer", json={"inputs": ["a b", "c d"]})  # opens the window
    assert warm.status_code == 200
    stats = handle.worker.stats
    forwards_before, expired_before = stats.forwards, stats.expired

    # Five one-word texts and one of 200 words: padding them together would cost 5.9 times their
    # real cost, past the default pad_factor (4), so the long one gets a group of its own, served
    # after the short ones.
    shorts = [gateway.post("/v1/models/synthetic/infer", json={"inputs": [f"short{i}"]}) for i in range(5)]
    long = gateway.post("/v1/models/synthetic/infer", json={"inputs": [" ".join(["w"] * 200)], "timeout_ms": 400})
    *short_rs, long_r = await asyncio.gather(*shorts, long)

    assert [r.json()["outputs"] for r in short_rs] == [[f"short{i}"] for i in range(5)]
    assert long_r.status_code == 504 and long_r.json()["error"]["code"] == "deadline_exceeded"
    await wait_until(lambda: stats.expired == expired_before + 1, 5)
    assert stats.forwards == forwards_before + 1  # the short group only
