"""bench/figures.py: the headline ratios and target verdicts computed from a run's records."""

from __future__ import annotations

import pytest

from bench.cost import commands_per_request
from bench.figures import COST_BASELINE, COST_OURS, COST_PEER, EMBEDDING_DIM, summary_figures, target_rows, wide


def point(suite: str, config: str, concurrency: int, rps: float, p99_ms: float, **extra: object) -> dict[str, object]:
    return {"suite": suite, "config": config, "concurrency": concurrency, "rps": rps, "items_per_s": rps,
            "p50_ms": extra.pop("p50_ms", 20.0), "p95_ms": p99_ms / 2, "p99_ms": p99_ms, **extra}


def run_records() -> dict[str, list[dict[str, object]]]:
    physical = [{"suite": "physical", "torch_threads": t, "batch_size": b, "items_per_s": ips, "batch_p50_ms": ms}
                for t, b, ips, ms in [(1, 1, 70.0, 14.0), (1, 16, 85.0, 190.0), (2, 1, 60.0, 15.0),
                                      (2, 16, 128.0, 125.0)]]
    peer = []
    for pair, (ours, theirs) in enumerate([(100.0, 80.0), (90.0, 90.0), (120.0, 60.0)]):
        peer.append(point("peer", "vramguard", 64, ours, 1000.0, pair=pair))
        peer.append(point("peer", "litserve", 64, theirs, 2000.0, pair=pair))
    scale = [point("scale", f"{w} workers", 64, 24.0 * w * (0.95 if w == 8 else 1), 100.0, workers=w) for w in (1, 8)]
    scale += [point("scale", f"{g} sim GPU x {k} workers", 64, rps, 100.0, gpus=g, workers_per_gpu=k)
              for g, k, rps in [(1, 1, 24.0), (2, 2, 90.0)]]
    scale.append(point("scale", "gateway ceiling (instant workers)", 64, 400.0, 50.0))
    strategies = [point("strategies", "dynamic batching (batch 32, 5 ms)", 1, 40.0, 30.0, p50_ms=16.0),
                  point("strategies", "naive FastAPI (no control)", 1, 50.0, 20.0, p50_ms=13.5)]
    fairness = [{"suite": "fairness", "point": "1-input alone", "p99_ms": 50.0},
                {"suite": "fairness", "point": "1-input beside 4 x 256", "p99_ms": 97.0, "p99_alone_ms": 50.0,
                 "full_forward_ms": 41.0, "max_wait_ms": 5.0, "bound_ms": 96.0, "met": False}]
    return {"physical": physical, "peer": peer, "scale": scale, "strategies": strategies, "fairness": fairness}


def test_figures_from_a_run() -> None:
    fig = summary_figures(run_records())
    # 1. The ceiling is the best row of any thread count; batch-1 latency the best batch-1 p50.
    assert (fig.ceiling_items_s, fig.ceiling_batch, fig.ceiling_threads, fig.batch1_p50_ms) == (128.0, 16, 2, 14.0)
    # 2. Peer ratios are per pair, ours over theirs, medians over pairs.
    assert fig.peer is not None
    assert fig.peer.rps_ratios == pytest.approx([1.25, 1.0, 2.0])
    assert fig.peer.p99_ratios == pytest.approx([0.5, 0.5, 0.5])
    assert fig.peer.ours_rps == 100.0 and fig.peer.theirs_rps == 80.0
    assert fig.scale_rps == {1: 24.0, 8: pytest.approx(182.4)} and fig.gateway_ceiling_rps == 400.0
    # 3. Placed workers (sim GPUs x workers per GPU) are their own figures, not the gateway ceiling.
    assert fig.placed_rps == {(1, 1): 24.0, (2, 2): 90.0}


def test_target_verdicts() -> None:
    rows = {row[0]: row for row in target_rows(summary_figures(run_records()))}
    assert rows["throughput at c=64 >= 1.25x LitServe"][2] == "**met**"  # median 1.25
    assert rows["throughput at c=64 >= 80% of the model's own limit"][2] == "**missed**"  # 100 / 128 = 78%
    assert rows["p99 at c=64 no worse than LitServe's"][2] == "**met**"
    assert rows["p50 at c=1 <= the naive in-process endpoint's + 2 ms"][1:] == [
        "+2.5 ms (16.0 vs 13.5 ms, the model alone 14.0 ms)", "**missed**"]
    assert rows["8 synthetic workers >= 7x 1 worker (until the gateway ceiling)"][2] == "**met**"  # 7.6x
    assert rows["1-input p99 beside 4 x 256-input clients <= its p99 alone + one full forward + window"][1:] == [
        "97.0 vs 50.0 + 41.0 + 5.0 = 96.0 ms", "**missed**"]
    assert rows["2 simulated GPUs x 2 workers vs 1 x 1 (placed as make up places them)"][1:] == [
        "3.75x (90 vs 24 req/s)", "**met**"]


def test_concurrency_1_target_from_alternating_rounds() -> None:
    """With the latency suite in the run, the c=1 row is the median of per-round differences
    (vramguard minus naive, each round measured back to back), not the strategies' two sweeps."""
    records = run_records()
    records["latency"] = [point("latency", config, 1, 80.0, 20.0, pair=pair, p50_ms=p50)
                          for pair, (ours, naive) in enumerate([(12.0, 11.0), (14.5, 11.0), (11.5, 11.0)])
                          for config, p50 in (("vramguard", ours), ("naive", naive))]
    fig = summary_figures(records)
    assert fig.latency is not None and fig.latency.deltas_ms == pytest.approx([1.0, 3.5, 0.5])
    row = next(r for r in target_rows(fig) if r[0].startswith("p50 at c=1"))
    assert row[1:] == ["+1.0 ms (min/med/max 0.50 / 1.00 / 3.50 over 3 alternating rounds; medians 12.0 vs "
                       "11.0 ms, the model alone 14.0 ms)", "**met**"]
    # A round missing one of the two servers (a failed start) is left out, not paired across rounds.
    records["latency"].append(point("latency", "vramguard", 1, 80.0, 20.0, pair=3, p50_ms=30.0))
    assert summary_figures(records).latency == fig.latency


def cost_point(config: str, pair: int, roles: dict[str, float], rps: float = 500.0) -> dict[str, object]:
    return {"suite": "cost", "config": config, "pair": pair, "concurrency": 64, "rps": rps,
            "cpu_us_per_request": roles, "server_cpu_us_per_request": sum(roles.values()),
            "client_cpu_us_per_request": 900.0, "answered": 1000}


def test_serving_cost_ratio_per_round_and_verdict() -> None:
    records = run_records()
    records["cost"] = [cost_point(COST_OURS, 0, {"gateway": 60.0, "redis": 20.0, "workers": 20.0}),
                       cost_point(COST_BASELINE, 0, {"server": 50.0}),
                       cost_point(COST_OURS, 1, {"gateway": 90.0, "redis": 30.0, "workers": 30.0}),
                       cost_point(COST_BASELINE, 1, {"server": 50.0})]
    fig = summary_figures(records)
    assert fig.cost is not None
    # 1. One ratio per round, ours over the bare endpoint's, each within its own round.
    assert fig.cost.ratios == pytest.approx([2.0, 3.0])
    # 2. Per-role medians over the rounds.
    assert fig.cost.us_by_config[COST_OURS]["gateway"] == 75.0
    assert fig.cost.us_by_config[COST_OURS]["total"] == 125.0
    row = next(r for r in target_rows(fig) if r[0].startswith("server CPU per request"))
    # 3. The median ratio 2.5 misses the 2x target; the split names each process.
    assert row[0] == "server CPU per request at c=64 (echoed text) <= 2x FastAPI echo endpoint's"
    assert row[2] == "**missed**" and "gateway 75, redis 25, workers 25" in row[1]


def test_cost_against_litserve_and_wide_replies_and_redis_commands() -> None:
    """Each (vramguard, other) pair of the cost suite is its own target row, per round: 0.35x
    LitServe's CPU, 2x the echo endpoint's for 384-float replies too; Redis commands per request
    (median over rounds) at most 1.0."""
    records = run_records()
    wide_ours, wide_echo, wide_peer = (wide(c, EMBEDDING_DIM) for c in (COST_OURS, COST_BASELINE, COST_PEER))
    records["cost"] = []
    for pair, (per_request, peer_us) in enumerate([(1.5, 400.0), (0.9, 300.0), (0.8, 280.0)]):
        ours = {**cost_point(COST_OURS, pair, {"gateway": 70.0, "redis": 10.0, "workers": 20.0}),
                "redis_commands_per_request": {"total": per_request, "evalsha": 0.1}}
        records["cost"] += [ours, cost_point(COST_BASELINE, pair, {"server": 60.0}),
                            cost_point(COST_PEER, pair, {"server": peer_us}),
                            cost_point(wide_ours, pair, {"gateway": 130.0, "redis": 10.0, "workers": 60.0}),
                            cost_point(wide_echo, pair, {"server": 90.0})]
    rows = {str(r[0]): r for r in target_rows(summary_figures(records))}
    peer = rows["server CPU per request at c=64 (echoed text) <= 0.35x LitServe (instant model)'s"]
    assert str(peer[1]).startswith("0.33x (min/med/max 0.25 / 0.33 / 0.36)") and peer[2] == "**met**"
    wide_row = rows["server CPU per request at c=64 (384-float replies) <= 2x FastAPI echo endpoint's"]
    assert str(wide_row[1]).startswith("2.22x") and wide_row[2] == "**missed**"  # 200 / 90
    assert not any(k.startswith("server CPU per request at c=64 (384-float replies) <= 0.35x") for k in rows)
    commands = rows[f"Redis commands per request at c=64, {COST_OURS} <= 1"]
    assert commands[1:] == ["0.90 (min/med/max 0.80 / 0.90 / 1.50, INFO commandstats deltas)", "**met**"]


def test_redis_commands_per_request_from_commandstats_deltas() -> None:
    """Deltas of each command's calls over the answered requests; commands that did not run are
    left out; the most frequent come first after the total."""
    before = {"xadd": 100, "evalsha": 50, "get": 10, "ping": 3}
    after = {"xadd": 300, "evalsha": 150, "get": 10, "ping": 3, "xack": 100}
    assert list(commands_per_request(before, after, answered=200).items()) == [
        ("total", 2.0), ("xadd", 1.0), ("evalsha", 0.5), ("xack", 0.5)]


def test_one_gateway_at_256_against_the_client_ceiling_there() -> None:
    """The c=256 point is reported against the client's ceiling at 256 and left out of the
    1-vs-2-gateway ratio, which stays at c=64."""
    records = run_records()
    records["ceiling"] = [{"suite": "ceiling", "concurrency": 64, "rps": 1200.0},
                          {"suite": "ceiling", "concurrency": 256, "rps": 1500.0}]
    records["gateways"] = [{"suite": "gateways", "gateways": n, "concurrency": c, "rps": rps, "pair": 0,
                            "cores_busy": 1.0, "cores": 2} for n, c, rps in ((1, 64, 400.0), (2, 64, 700.0),
                                                                            (1, 256, 600.0))]
    fig = summary_figures(records)
    assert fig.gateways_rps == {1: [400.0], 2: [700.0]}
    row = next(r for r in target_rows(fig) if str(r[0]).startswith("1 gateway, instant workers, c=256"))
    assert row[1:] == ["600 req/s (min/med/max 600.00 / 600.00 / 600.00) = 40% of the client's own ceiling "
                       "there (1500 req/s)", "reported"]


@pytest.mark.parametrize(("one", "two", "busy", "verdict"), [
    (400.0, 700.0, 1.0, "**met**"), (400.0, 410.0, 1.0, "**missed**"), (1000.0, 1010.0, 1.0, "**met**"),
    (400.0, 410.0, 1.9, "**not shown** (the machine was already full at 1 gateway)")])
def test_scale_out_verdict_counts_the_client_ceiling(one: float, two: float, busy: float, verdict: str) -> None:
    """2 gateways must beat 1 by 10 %, unless 1 gateway already reaches 80 % of the client's ceiling
    (met) or server and client already keep 80 % of the cores busy (not shown either way)."""
    records = run_records()
    records["ceiling"] = [{"suite": "ceiling", "rps": 1200.0}]
    records["gateways"] = [{"suite": "gateways", "gateways": n, "rps": rps, "pair": 0, "cores_busy": busy, "cores": 2}
                           for n, rps in ((1, one), (2, two))]
    row = next(r for r in target_rows(summary_figures(records)) if r[0].startswith("2 gateway processes"))
    assert row[2] == verdict


@pytest.mark.parametrize(("met", "verdict"), [(True, "**met**"), (False, "**missed**")])
def test_fairness_section_states_the_bound_and_its_verdict(met: bool, verdict: str) -> None:
    from bench.report import _fairness

    alone = {"suite": "fairness", "point": "1-input alone", "requests": 400, "p50_ms": 44.0, "p99_ms": 54.5,
             "max_ms": 60.0}
    mixed = {**alone, "point": "1-input beside 4 x 256", "p99_ms": 95.1 if met else 140.0, "config": "synthetic",
             "bulk": {"requests": 58, "items_per_s": 742.4, "p50_ms": 1384.0, "p99_ms": 1448.5},
             "p99_alone_ms": 54.5, "full_forward_ms": 40.7, "max_wait_ms": 5.0, "bound_ms": 100.2, "forwards": 548,
             "met": met}
    text = _fairness({"fairness": [alone, mixed]})
    assert f"= 100.2 ms (548 forwards measured): {verdict}" in text
    assert "| 1-input beside 4 x 256 |" in text
    assert _fairness({}) == ""


def test_peer_section_names_pairs_and_median_idle_cpu() -> None:
    """The peer section labels each row with its pair and states each server's median idle CPU
    (the reason each is measured alone); the latency section labels rows by round."""
    from bench.report import _latency, _peer

    def served(suite: str, config: str, pair: int, idle: float | None) -> dict[str, object]:
        extra = {"idle_cpu_share": idle} if idle is not None else {}
        return point(suite, config, 64, 100.0, 500.0, pair=pair, max_ms=600.0, peak_rss_mb=700.0, requests=800,
                     **extra)

    groups = run_records()
    groups["peer"] = [served("peer", c, pair, idle) for pair, idles in enumerate([(0.02, 0.10), (0.03, 0.14),
                                                                                   (0.04, 0.12)])
                      for c, idle in zip(("vramguard", "litserve"), idles, strict=True)]
    fig = summary_figures(groups)
    text = _peer(groups, fig)
    assert "(median over the rounds): vramguard 3.0%, litserve 12.0%" in text
    assert "| pair 2: litserve | 64 |" in text
    assert _latency(groups, fig) == ""  # no latency suite in the run: no section
    groups["latency"] = [served("latency", c, 0, None) for c in ("vramguard", "naive")]
    assert "| round 0: naive | 64 |" in _latency(groups, summary_figures(groups))
