"""The headline figures computed from the records of one run: the physical limit, the client's
ceiling, the A/B ratios against LitServe, scale, overhead at concurrency 1, and the
performance targets (stated in target_rows) checked against them (all as ratios within the same run)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

Record = dict[str, object]
PEER_CONCURRENCY = 64
GATEWAY_CONCURRENCY = 256


@dataclass(frozen=True)
class PeerFigures:
    """vramguard vs LitServe at one concurrency, over A/B pairs: per-pair ratios and medians."""

    concurrency: int
    rps_ratios: list[float]  # ours / theirs, one per pair
    p99_ratios: list[float]  # ours / theirs (below 1 is better)
    ours_rps: float  # medians over the pairs
    theirs_rps: float
    ours_p95: float
    theirs_p95: float
    ours_p99: float
    theirs_p99: float


@dataclass(frozen=True)
class LatencyFigures:
    """Concurrency 1 over alternating rounds (suite `latency`): per round, vramguard's p50 minus
    the naive in-process endpoint's; the medians of each over the rounds."""

    deltas_ms: list[float]  # ours - naive, one per round
    ours_p50_ms: float
    naive_p50_ms: float


@dataclass(frozen=True)
class CostFigures:
    """Serving CPU per request (bench/cost.py) over alternating rounds: per round, vramguard's
    server CPU over the bare endpoint's; per configuration, the median µs of each role."""

    ratios: list[float]  # vramguard (default settings) / bare endpoint, one per round
    us_by_config: dict[str, dict[str, float]]  # config -> role -> median µs per request (+ "total", "client")
    # (ours, other) -> per-round ratios, for echoed text and EMBEDDING_DIM-float replies
    ratios_by_pair: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    commands: dict[str, list[float]] = field(default_factory=dict)  # config -> Redis commands per request, per round


COST_OURS = "vramguard (instant worker)"
COST_BASELINE = "FastAPI echo endpoint"
COST_PEER = "LitServe (instant model)"
EMBEDDING_DIM = 384  # minilm's reply: this many float32 per input


def wide(config: str, dim: int) -> str:
    """The cost suite's config name of `config` answering `dim` floats per input (0: echoed text)."""
    return f"{config}, {dim}-float replies" if dim else config


def paired(records: list[Record], *configs: str) -> list[dict[str, Record]]:
    """The rounds (records sharing a `pair` number) that hold a record of every one of `configs`,
    each as config -> record, in round order."""
    rounds: dict[int, dict[str, Record]] = {}
    for r in records:
        rounds.setdefault(int(r["pair"]), {})[str(r["config"])] = r  # type: ignore[call-overload]
    return [rounds[k] for k in sorted(rounds) if set(configs) <= rounds[k].keys()]


def latency_figures(records: list[Record]) -> LatencyFigures | None:
    """Pair the latency suite's records by round; None without a round holding both servers."""
    full = paired(records, "vramguard", "naive")
    if not full:
        return None
    ours, naive = ([float(p[c]["p50_ms"]) for p in full] for c in ("vramguard", "naive"))  # type: ignore[arg-type]
    return LatencyFigures(deltas_ms=[a - b for a, b in zip(ours, naive, strict=True)],
                          ours_p50_ms=float(np.median(ours)), naive_p50_ms=float(np.median(naive)))


def cpu_ratios(records: list[Record], ours: str, base: str) -> list[float]:
    """Server CPU per request of `ours` over `base`, one per round holding both."""
    return [float(p[ours]["server_cpu_us_per_request"])  # type: ignore[arg-type]
            / max(float(p[base]["server_cpu_us_per_request"]), 1e-9) for p in paired(records, ours, base)]  # type: ignore[arg-type]


def cost_figures(records: list[Record]) -> CostFigures | None:
    """Pair the cost suite's records by round; None without a round holding both COST_OURS and COST_BASELINE."""
    ratios = cpu_ratios(records, COST_OURS, COST_BASELINE)
    if not ratios:
        return None
    pairs = {(wide(COST_OURS, dim), wide(other, dim)): cpu_ratios(records, wide(COST_OURS, dim), wide(other, dim))
             for dim in (0, EMBEDDING_DIM) for other in (COST_BASELINE, COST_PEER)}
    commands: dict[str, list[float]] = {}
    for r in records:
        if r.get("redis_commands_per_request"):
            per = dict(r["redis_commands_per_request"])  # type: ignore[call-overload]
            commands.setdefault(str(r["config"]), []).append(float(per["total"]))
    by_config: dict[str, list[Record]] = {}
    for r in records:
        by_config.setdefault(str(r["config"]), []).append(r)
    medians = {config: _cost_medians(rs) for config, rs in by_config.items()}
    return CostFigures(ratios=ratios, us_by_config=medians, ratios_by_pair={k: v for k, v in pairs.items() if v},
                       commands=commands)


def _cost_medians(records: list[Record]) -> dict[str, float]:
    roles = {role for r in records for role in dict(r["cpu_us_per_request"])}  # type: ignore[call-overload]
    out = {role: float(np.median([float(dict(r["cpu_us_per_request"])[role]) for r in records]))  # type: ignore[call-overload]
           for role in sorted(roles)}
    out["total"] = float(np.median([float(r["server_cpu_us_per_request"]) for r in records]))  # type: ignore[arg-type]
    out["client"] = float(np.median([float(r["client_cpu_us_per_request"]) for r in records]))  # type: ignore[arg-type]
    out["rps"] = float(np.median([float(r["rps"]) for r in records]))  # type: ignore[arg-type]
    return out


def gateway_rps(records: list[Record]) -> dict[int, list[float]]:
    """The gateways suite's req/s by gateway count at concurrency 64, one value per round."""
    out: dict[int, list[float]] = {}
    for r in records:
        if r.get("concurrency", PEER_CONCURRENCY) != PEER_CONCURRENCY:
            continue
        out.setdefault(int(r["gateways"]), []).append(float(r["rps"]))  # type: ignore[call-overload, arg-type]
    return out


def machine_busy(records: list[Record]) -> float | None:
    """Median fraction of the machine's cores busy over the 1-gateway points: all processes,
    other users' too (bench/cost.py's machine_cores_busy), else server and client alone
    (cores_busy); None when not recorded."""
    shares = [float(r.get("machine_cores_busy") or r["cores_busy"]) / float(r["cores"])  # type: ignore[arg-type]
              for r in records if r.get("gateways") == 1 and r.get("cores_busy") is not None and r.get("cores")
              and r.get("concurrency", PEER_CONCURRENCY) == PEER_CONCURRENCY]
    return float(np.median(shares)) if shares else None


@dataclass
class Figures:
    """Everything RESULTS.md quotes beyond the raw tables; None where a suite did not run."""

    ceiling_items_s: float | None = None
    ceiling_batch: int | None = None
    ceiling_threads: int | None = None
    batch1_p50_ms: float | None = None
    client_ceiling_rps: float | None = None
    peer: PeerFigures | None = None
    scale_rps: dict[int, float] = field(default_factory=dict)
    placed_rps: dict[tuple[int, int], float] = field(default_factory=dict)  # (sim GPUs, workers per GPU)
    gateway_ceiling_rps: float | None = None
    c1_p50_ms: dict[str, float] = field(default_factory=dict)  # strategy config -> p50 at concurrency 1
    latency: LatencyFigures | None = None  # concurrency 1, vramguard and the naive endpoint alternating
    cost: CostFigures | None = None
    gateways_rps: dict[int, list[float]] = field(default_factory=dict)  # gateway processes -> req/s per round
    gateways_busy: float | None = None  # share of the machine's cores busy at 1 gateway
    gateway_256_rps: list[float] = field(default_factory=list)  # 1 gateway at GATEWAY_CONCURRENCY, per round
    client_ceiling_256_rps: float | None = None  # the client against the trivial endpoint there
    fairness: Record | None = None  # the fairness suite's mixed point (p99 beside bulk, its bound, verdict)


def spread(values: list[float]) -> str:
    """'min / median / max' of `values`, 2 decimals."""
    lo, mid, hi = np.min(values), np.median(values), np.max(values)
    return f"{lo:.2f} / {mid:.2f} / {hi:.2f}"


def peer_figures(records: list[Record]) -> PeerFigures | None:
    """Pair the peer suite's records by `pair` (vramguard, litserve); None without a full pair."""
    full = paired(records, "vramguard", "litserve")
    if not full:
        return None

    def med(config: str, key: str) -> float:
        return float(np.median([float(p[config][key]) for p in full]))  # type: ignore[arg-type]

    return PeerFigures(
        concurrency=int(full[0]["vramguard"]["concurrency"]),  # type: ignore[call-overload]
        rps_ratios=[float(p["vramguard"]["rps"]) / max(float(p["litserve"]["rps"]), 1e-9) for p in full],  # type: ignore[arg-type]
        p99_ratios=[float(p["vramguard"]["p99_ms"]) / max(float(p["litserve"]["p99_ms"]), 1e-9) for p in full],  # type: ignore[arg-type]
        ours_rps=med("vramguard", "rps"), theirs_rps=med("litserve", "rps"),
        ours_p95=med("vramguard", "p95_ms"), theirs_p95=med("litserve", "p95_ms"),
        ours_p99=med("vramguard", "p99_ms"), theirs_p99=med("litserve", "p99_ms"),
    )


def summary_figures(groups: dict[str, list[Record]]) -> Figures:
    """Compute the Figures from records grouped by suite."""
    fig = Figures()
    physical = groups.get("physical", [])
    if physical:
        best = max(physical, key=lambda r: float(r["items_per_s"]))  # type: ignore[arg-type]
        fig.ceiling_items_s, fig.ceiling_batch = float(best["items_per_s"]), int(best["batch_size"])  # type: ignore[arg-type, call-overload]
        fig.ceiling_threads = int(best["torch_threads"])  # type: ignore[call-overload]
        ones = [float(r["batch_p50_ms"]) for r in physical if r["batch_size"] == 1]  # type: ignore[arg-type]
        fig.batch1_p50_ms = min(ones) if ones else None  # the model's best batch-1 latency, any thread count
    client = [float(r["rps"]) for r in groups.get("ceiling", [])]  # type: ignore[arg-type]
    fig.client_ceiling_rps = max(client) if client else None
    fig.peer = peer_figures(groups.get("peer", []))
    for r in groups.get("scale", []):
        if "gpus" in r:
            fig.placed_rps[(int(r["gpus"]), int(r["workers_per_gpu"]))] = float(r["rps"])  # type: ignore[call-overload, arg-type]
        elif "workers" in r:
            fig.scale_rps[int(r["workers"])] = float(r["rps"])  # type: ignore[call-overload, arg-type]
        else:
            fig.gateway_ceiling_rps = max(fig.gateway_ceiling_rps or 0.0, float(r["rps"]))  # type: ignore[arg-type]
    for r in groups.get("strategies", []):
        if r["concurrency"] == 1:
            fig.c1_p50_ms[str(r["config"])] = float(r["p50_ms"])  # type: ignore[arg-type]
    fig.latency = latency_figures(groups.get("latency", []))
    fig.cost = cost_figures(groups.get("cost", []))
    fig.gateways_rps = gateway_rps(groups.get("gateways", []))
    fig.gateways_busy = machine_busy(groups.get("gateways", []))
    fig.gateway_256_rps = [float(r["rps"]) for r in groups.get("gateways", [])  # type: ignore[arg-type]
                           if r.get("concurrency") == GATEWAY_CONCURRENCY and r.get("gateways") == 1]
    fig.client_ceiling_256_rps = next((float(r["rps"]) for r in groups.get("ceiling", [])  # type: ignore[arg-type]
                                       if r.get("concurrency") == GATEWAY_CONCURRENCY), None)
    fig.fairness = next((r for r in groups.get("fairness", []) if "bound_ms" in r), None)
    return fig


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**missed**")


def target_rows(fig: Figures) -> list[list[object]]:
    """[target, measured, verdict] rows, one per performance target this benchmark checks."""
    rows: list[list[object]] = []
    peer = fig.peer
    if peer is not None:
        med_ratio = float(np.median(peer.rps_ratios))
        rows.append(["throughput at c=64 >= 1.25x LitServe",
                     f"{med_ratio:.2f}x (min/med/max {spread(peer.rps_ratios)})", _verdict(med_ratio >= 1.25)])
        if fig.ceiling_items_s:
            frac = peer.ours_rps / fig.ceiling_items_s
            rows.append(["throughput at c=64 >= 80% of the model's own limit",
                         f"{100 * frac:.1f}% ({peer.ours_rps:.1f} of {fig.ceiling_items_s:.1f} items/s)",
                         _verdict(frac >= 0.8)])
        med_p99 = float(np.median(peer.p99_ratios))
        rows.append(["p99 at c=64 no worse than LitServe's",
                     f"{med_p99:.2f}x LitServe's (min/med/max {spread(peer.p99_ratios)}); "
                     f"{peer.ours_p99:.0f} vs {peer.theirs_p99:.0f} ms", _verdict(med_p99 <= 1.0)])
    rows += latency_rows(fig)
    if 1 in fig.scale_rps and 8 in fig.scale_rps:
        ratio = fig.scale_rps[8] / max(fig.scale_rps[1], 1e-9)
        capped = min(7.0, (fig.gateway_ceiling_rps or float("inf")) / max(fig.scale_rps[1], 1e-9))
        rows.append(["8 synthetic workers >= 7x 1 worker (until the gateway ceiling)",
                     f"{ratio:.2f}x ({fig.scale_rps[8]:.0f} vs {fig.scale_rps[1]:.0f} req/s; "
                     f"gateway ceiling {fig.gateway_ceiling_rps or 0:.0f} req/s)", _verdict(ratio >= capped)])
    rows += serving_rows(fig)
    if fig.fairness is not None:
        f = fig.fairness
        rows.append(["1-input p99 beside 4 x 256-input clients <= its p99 alone + one full forward + window",
                     f"{f['p99_ms']} vs {f['p99_alone_ms']} + {f['full_forward_ms']} + {f['max_wait_ms']} = "
                     f"{f['bound_ms']} ms", _verdict(bool(f["met"]))])
    if (1, 1) in fig.placed_rps and (2, 2) in fig.placed_rps:
        ratio = fig.placed_rps[(2, 2)] / max(fig.placed_rps[(1, 1)], 1e-9)
        rows.append(["2 simulated GPUs x 2 workers vs 1 x 1 (placed as make up places them)",
                     f"{ratio:.2f}x ({fig.placed_rps[(2, 2)]:.0f} vs {fig.placed_rps[(1, 1)]:.0f} req/s)",
                     _verdict(ratio >= 3.5)])
    return rows


def latency_rows(fig: Figures) -> list[list[object]]:
    """The concurrency-1 target row: from the alternating rounds of the latency suite when it ran,
    else from the strategies suite's two sweeps (measured minutes apart)."""
    # The naive endpoint runs the same model in-process on the same machine, so the difference is
    # what the broker (gateway, Redis, worker) adds; the model's batch-1 latency is shown for scale.
    model = f", the model alone {fig.batch1_p50_ms:.1f} ms" if fig.batch1_p50_ms is not None else ""
    target = f"p50 at c=1 <= the naive in-process endpoint's + {BROKER_PRICE_MS:.0f} ms"
    if fig.latency is not None:
        lat = fig.latency
        overhead = float(np.median(lat.deltas_ms))
        return [[target, f"{overhead:+.1f} ms (min/med/max {spread(lat.deltas_ms)} over {len(lat.deltas_ms)} "
                 f"alternating rounds; medians {lat.ours_p50_ms:.1f} vs {lat.naive_p50_ms:.1f} ms{model})",
                 _verdict(overhead <= BROKER_PRICE_MS)]]
    dynamic = next((v for k, v in fig.c1_p50_ms.items() if k.startswith("dynamic")), None)
    naive = next((v for k, v in fig.c1_p50_ms.items() if k.startswith("naive")), None)
    if dynamic is None or naive is None:
        return []
    overhead = dynamic - naive
    return [[target, f"{overhead:+.1f} ms ({dynamic:.1f} vs {naive:.1f} ms{model})",
             _verdict(overhead <= BROKER_PRICE_MS)]]


BROKER_PRICE_MS = 2.0  # what the broker may add to the median at concurrency 1 over an in-process endpoint
COST_TARGET = 2.0  # vramguard's serving CPU per request at most this many times the FastAPI echo endpoint's
PEER_COST_TARGET = 0.35  # ... and at most this fraction of LitServe's (instant models both)
COMMANDS_TARGET = 1.0  # Redis commands per request at concurrency 64
SCALE_OUT_GAIN = 1.1  # 2 gateways must beat 1 by this much, unless 1 is already near the client's ceiling
CLIENT_BOUND = 0.8  # a figure at this fraction of the client's own ceiling counts as client-limited


def serving_rows(fig: Figures) -> list[list[object]]:
    """Target rows of the serving cost (CPU per request) and of the gateway scale-out."""
    rows: list[list[object]] = []
    if fig.cost is not None:
        rows += cost_rows(fig.cost)
    if 1 in fig.gateways_rps and 2 in fig.gateways_rps:
        one, two = (float(np.median(fig.gateways_rps[n])) for n in (1, 2))
        gain = two / max(one, 1e-9)
        ceiling = fig.client_ceiling_rps
        bound = ceiling is not None and one >= CLIENT_BOUND * ceiling
        of_ceiling = f"; client's own ceiling {ceiling:.0f} req/s ({100 * two / ceiling:.0f}%)" if ceiling else ""
        busy = fig.gateways_busy
        saturated = busy is not None and busy >= CLIENT_BOUND
        of_machine = f"; {100 * busy:.0f}% of the machine's cores busy at 1 gateway" if busy else ""
        verdict = _verdict(gain >= SCALE_OUT_GAIN or bound)
        if verdict == "**missed**" and saturated:
            verdict = "**not shown** (the machine was already full at 1 gateway)"
        rows.append(["2 gateway processes serve more than 1 (until the client's ceiling)",
                     f"{gain:.2f}x ({two:.0f} vs {one:.0f} req/s, medians){of_ceiling}{of_machine}", verdict])
    if fig.gateway_256_rps:
        rps = float(np.median(fig.gateway_256_rps))
        limit = fig.client_ceiling_256_rps
        of = f" = {100 * rps / limit:.0f}% of the client's own ceiling there ({limit:.0f} req/s)" if limit else ""
        rows.append([f"1 gateway, instant workers, c={GATEWAY_CONCURRENCY}: req/s against the client's ceiling",
                     f"{rps:.0f} req/s (min/med/max {spread(fig.gateway_256_rps)}){of}", "reported"])
    return rows


def cost_rows(cost: CostFigures) -> list[list[object]]:
    """Target rows of CPU per request (against the echo endpoint and LitServe, for echoed text and
    EMBEDDING_DIM-float replies) and of Redis commands per request."""
    rows: list[list[object]] = []
    for (ours, other), ratios in cost.ratios_by_pair.items():
        peer = other.startswith(COST_PEER)
        bound = PEER_COST_TARGET if peer else COST_TARGET
        mine, theirs = cost.us_by_config[ours], cost.us_by_config[other]
        split = ", ".join(f"{role} {mine[role]:.0f}" for role in mine if role not in ("total", "client", "rps"))
        med = float(np.median(ratios))
        reply = ours.removeprefix(COST_OURS).removeprefix(", ") or "echoed text"
        rows.append([f"server CPU per request at c={PEER_CONCURRENCY} ({reply}) <= {bound:g}x {other.split(',')[0]}'s",
                     f"{med:.2f}x (min/med/max {spread(ratios)}); {mine['total']:.0f} µs ({split}) "
                     f"vs {theirs['total']:.0f} µs", _verdict(med <= bound)])
    for config, per_round in cost.commands.items():
        med = float(np.median(per_round))
        rows.append([f"Redis commands per request at c={PEER_CONCURRENCY}, {config} <= {COMMANDS_TARGET:g}",
                     f"{med:.2f} (min/med/max {spread(per_round)}, INFO commandstats deltas)",
                     _verdict(med <= COMMANDS_TARGET)])
    return rows
