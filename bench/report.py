"""Turn results.jsonl into bench/RESULTS.md (tables, ratios, the targets) and
bench/results/plot.png (throughput and p95 against concurrency, one line per configuration).
bench/ANALYSIS.md, written by hand, is appended to RESULTS.md as it is."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench import generate_figures
from bench.figures import COST_BASELINE, Figures, PeerFigures, spread, summary_figures, target_rows

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
ANALYSIS_MD = ROOT / "bench" / "ANALYSIS.md"
DEFAULT_OUT = ROOT / "bench" / "results"
# The docs page whose headline table each default run rewrites (between HEADLINE_MARKERS).
HEADLINE_MD = ROOT / "docs" / "guides" / "measure.md"
# What a run rewrites itself does not make the measured code "edited".
UNTRACKED_OUTPUTS = ("status", "--porcelain", "--", ".", ":!bench/results", ":!bench/RESULTS.md",
                     ":!docs/guides/measure.md")
HEADLINE_MARKERS = ("<!-- bench:targets -->", "<!-- /bench:targets -->")
Record = dict[str, object]
SERVING_HEADERS = ["configuration", "conc.", "req/s", "% of limit", "p50 ms", "p95 ms", "p99 ms", "max ms",
                   "mean batch", "queue delay ms", "peak RSS MiB", "device MiB (heartbeat)", "requests", "errors"]


def meta_record(cfg: object, note: str) -> Record:
    """Machine, date, commit, load average and settings of this run."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"suite": "meta", "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git("rev-parse", "--short", "HEAD") + (" + local edits" if git(*UNTRACKED_OUTPUTS) else ""),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu})",
            "python": platform.python_version(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "note": note, "config": {k: str(v) for k, v in vars(cfg).items() if k != "out_dir"}}


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table; None prints as an em dash."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join("—" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def load_records(out_dir: Path) -> dict[str, list[Record]]:
    """results.jsonl grouped by suite. Raises FileNotFoundError naming what writes it when missing."""
    path = out_dir / "results.jsonl"
    if not path.is_file():
        singles = sorted(p.name for p in out_dir.glob("*.jsonl")) if out_dir.is_dir() else []
        found = f" (found {', '.join(singles)}: a single suite's records, which carry no run header)" if singles else ""
        raise FileNotFoundError(f"no {path}{found}: the report is written from a whole run, which "
                                f"`python -m bench all --out {out_dir}` records there")
    grouped: dict[str, list[Record]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            grouped[str(record["suite"])].append(record)
    return grouped


def serving_rows(records: list[Record], ceiling: float | None) -> list[list[object]]:
    """One SERVING_HEADERS row per load point; '% of limit' is items/s over the physical limit."""
    def pct(r: Record) -> str | None:
        return f"{100 * float(r['items_per_s']) / ceiling:.0f}%" if ceiling else None  # type: ignore[arg-type]

    def device(r: Record) -> str | None:
        memory = dict(r.get("device_memory") or {})  # type: ignore[call-overload]
        return ", ".join(f"{k.removesuffix('_mib')} {v}" for k, v in memory.items()) or None

    def errors(r: Record) -> str:
        return ", ".join(f"{k}: {v}" for k, v in dict(r.get("errors") or {}).items()) or "0"  # type: ignore[call-overload]

    return [[r.get("config"), r["concurrency"], r["rps"], pct(r), r["p50_ms"], r["p95_ms"], r["p99_ms"], r["max_ms"],
             r.get("mean_batch"), r.get("queue_delay_ms"), r["peak_rss_mb"], device(r), r["requests"], errors(r)]
            for r in records]


def plot(groups: dict[str, list[Record]], ceiling: float | None, peer: PeerFigures | None, path: Path) -> None:
    """Throughput (req/s) and p95 (ms, log scale) against concurrency, one line per configuration.

    Raises ModuleNotFoundError when matplotlib is not installed (the bench extra brings it).
    """
    # Imported here, not at the top: `python -m bench --help` and the suites that draw nothing
    # work without matplotlib.
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (ax_rps, ax_p95) = plt.subplots(1, 2, figsize=(13, 5))
    by_config: dict[str, list[Record]] = defaultdict(list)
    for record in groups.get("strategies", []):
        by_config[str(record["config"])].append(record)
    for config, records in by_config.items():
        conc = [r["concurrency"] for r in records]
        ax_rps.plot(conc, [r["rps"] for r in records], marker="o", label=config)
        ax_p95.plot(conc, [r["p95_ms"] for r in records], marker="o", label=config)
    if ceiling:
        ax_rps.axhline(ceiling, color="grey", linestyle="--", label=f"model's own limit ({ceiling:.0f} items/s)")
    if peer is not None:
        for name, rps, p95, marker, color in (("vramguard", peer.ours_rps, peer.ours_p95, "*", "black"),
                                              ("LitServe", peer.theirs_rps, peer.theirs_p95, "X", "red")):
            ax_rps.scatter([peer.concurrency], [rps], marker=marker, color=color, s=150, zorder=5,
                           label=f"{name}, batch 32 (A/B median)")
            ax_p95.scatter([peer.concurrency], [p95], marker=marker, color=color, s=150, zorder=5)
    ax_rps.set(xlabel="concurrency (closed-loop clients)", ylabel="req/s (1 sentence each)", title="minilm throughput")
    ax_p95.set(xlabel="concurrency (closed-loop clients)", ylabel="p95 latency (ms)", yscale="log",
               title="minilm p95 latency")
    for ax in (ax_rps, ax_p95):
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    ax_rps.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_dir: Path) -> Path:
    """Write RESULTS.md and out_dir/plot.png from out_dir/results.jsonl; returns RESULTS.md's path:
    bench/RESULTS.md for the default results folder, else RESULTS.md inside `out_dir`."""
    groups = load_records(out_dir)
    results_md = RESULTS_MD if out_dir.resolve() == DEFAULT_OUT.resolve() else out_dir / "RESULTS.md"
    fig = summary_figures(groups)
    plot(groups, fig.ceiling_items_s, fig.peer, out_dir / "plot.png")
    parts = [_header(groups, out_dir, results_md), _targets(fig), _limits(groups, fig), _strategies(groups, fig),
             _latency(groups, fig), _peer(groups, fig), _scale(groups, fig), _image(groups), _cost(groups, fig),
             _gateways(groups, fig), _fairness(groups), generate_figures.section(groups.get("generate", []))]
    if ANALYSIS_MD.exists():
        parts.append(ANALYSIS_MD.read_text().strip())
    results_md.write_text("\n\n".join(p for p in parts if p) + "\n")
    if results_md == RESULTS_MD:
        update_headline(groups, fig)
    return results_md


def update_headline(groups: dict[str, list[Record]], fig: Figures, page: Path = HEADLINE_MD) -> bool:
    """Replace the block between HEADLINE_MARKERS in the docs' "Measure it" page with this run's
    targets table, so the published headline figures always match RESULTS.md. Returns False (and
    changes nothing) when the markers are missing."""
    start, end = HEADLINE_MARKERS
    text = page.read_text()
    if start not in text or end not in text:
        return False
    meta = (groups.get("meta") or [{}])[0]
    note = f" {meta['note']}" if meta.get("note") else ""
    run = f"{meta.get('date')} (commit {meta.get('commit')}, {meta.get('machine')})"
    targets = table(["target", "measured", "verdict"], target_rows(fig))
    block = f"{start}\nFrom the run of {run}.{note}\n\n{targets}\n{end}"
    head, rest = text.split(start, 1)
    page.write_text(head + block + rest.split(end, 1)[1])
    return True


def _header(groups: dict[str, list[Record]], out_dir: Path, results_md: Path) -> str:
    meta = (groups.get("meta") or [{}])[0]
    wall = (groups.get("wall") or [{}])[0].get("wall_s")
    cfg = meta.get("config", {})
    assert isinstance(cfg, dict)
    note = f"\n> **{meta['note']}**\n" if meta.get("note") else ""
    plot_rel = os.path.relpath(out_dir / "plot.png", results_md.parent)
    return (f"# vramguard benchmark results\n{note}\n"
            f"Reproduce with `make bench` (`python -m bench all`; wall time of this run: {wall} s). Generated by "
            f"`bench/report.py` from `{os.path.relpath(out_dir / 'results.jsonl', ROOT)}`.\n\n"
            f"- date: {meta.get('date')}; commit: {meta.get('commit')}\n- machine: {meta.get('machine')}; "
            f"Python {meta.get('python')}; load average at start: {meta.get('loadavg_at_start')}\n"
            f"- each point: {cfg.get('warmup_s')} s warm-up, then {cfg.get('duration_s')} s measured; closed-loop "
            f"clients, one sentence per request from `bench/corpus.txt`; torch threads: {cfg.get('torch_threads')} "
            f"for one model process, split evenly when two share the cores\n- peak RSS is the CPU stand-in for peak "
            f"GPU memory: VmHWM summed over all the server's processes (vramguard: Redis + gateway + workers); "
            f"'device MiB' sums the workers' heartbeat `*_bytes` fields when they publish any (GPU or simulated "
            f"device), else shows a dash\n\n"
            f"![throughput and p95 against concurrency]({plot_rel})")


def _targets(fig: Figures) -> str:
    rows = target_rows(fig)
    return "## Targets (ratios within this run)\n\n" + table(["target", "measured", "verdict"], rows) if rows else ""


def _limits(groups: dict[str, list[Record]], fig: Figures) -> str:
    physical = [[r["torch_threads"], r["batch_size"], r["items_per_s"], r["batch_p50_ms"], r["batch_mean_ms"],
                 r["forwards"]] for r in groups.get("physical", [])]
    client = [[r["concurrency"], r["rps"], r["p50_ms"], r["p99_ms"], r["requests"]] for r in groups.get("ceiling", [])]
    return (f"## The limits\n\n**The model's own limit** (one process, `collate` + `forward` of "
            f"worker/models/minilm.py in a tight loop over the whole corpus, preprocessing included): "
            f"**{fig.ceiling_items_s} items/s** (batch {fig.ceiling_batch}, {fig.ceiling_threads} torch threads, the "
            f"best of all rows); batch-1 latency p50 **{fig.batch1_p50_ms} ms** (the best thread count).\n\n"
            + table(["torch threads", "batch size", "items/s", "p50 ms per batch", "mean ms per batch", "forwards"],
                    physical)
            + f"\n\n**The load client's own ceiling** against a trivial endpoint (bare ASGI app on uvicorn, same "
            f"machine, so this is client + server sharing the cores): **{fig.client_ceiling_rps} req/s**. "
            f"{_client_verdict(groups, fig)}\n\n"
            + table(["concurrency", "req/s", "p50 ms", "p99 ms", "requests"], client))


def _client_verdict(groups: dict[str, list[Record]], fig: Figures) -> str:
    """Whether the serving figures could be the client's limit rather than the server's."""
    rates = {str(r.get("config")): float(r["rps"]) for suite in ("strategies", "peer", "scale")  # type: ignore[arg-type]
             for r in groups.get(suite, [])}
    if not rates or not fig.client_ceiling_rps:
        return ""
    top = max(rates, key=rates.__getitem__)
    if rates[top] < 0.5 * fig.client_ceiling_rps:
        return "Every serving figure below is under half of it, so the client is not what limits them."
    return (f"The highest serving figure ({top}: {rates[top]:.0f} req/s) comes within 2x of it: read that one as a "
            "lower bound, limited by the client sharing the cores as much as by the server.")


def _strategies(groups: dict[str, list[Record]], fig: Figures) -> str:
    rows = serving_rows(groups.get("strategies", []), fig.ceiling_items_s)
    overhead = [[k, v, fig.batch1_p50_ms, round(v - fig.batch1_p50_ms, 2) if fig.batch1_p50_ms else None]
                for k, v in fig.c1_p50_ms.items()]
    return ("## The seed's strategies on minilm (same load)\n\nThe seed's three strategies as settings: serial = "
            "`max_batch_size=1`; semaphore-like = 2 workers with batch 1; dynamic batching = batch 32, "
            "`max_wait_ms=5`; two levels = that plus `max_inflight_batches=2`; several workers = 2 workers of "
            "batch 32 on the one device. The naive FastAPI endpoint calls the model in a sync handler (thread "
            "pool, no limit, no batching) and is the baseline row.\n\n" + table(SERVING_HEADERS, rows)
            + "\n\n### Overhead at concurrency 1 (p50 minus the model's own batch-1 p50)\n\n"
            + table(["configuration", "p50 ms at c=1", "model batch-1 p50 ms", "overhead ms"], overhead))


def _rows_by_round(records: list[Record], fig: Figures, word: str) -> list[list[object]]:
    """The serving table's rows of an alternating suite, each named '<word> <round>: <config>'."""
    rows = serving_rows(records, fig.ceiling_items_s)
    for row, record in zip(rows, records, strict=True):
        row[0] = f"{word} {record['pair']}: {record['config']}"
    return rows


def _idle_line(records: list[Record]) -> str:
    """'- idle CPU ...' with each server's median idle share of one core over the rounds, or ''."""
    idle: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.get("idle_cpu_share") is not None:
            idle[str(r["config"])].append(float(r["idle_cpu_share"]))  # type: ignore[arg-type]
    if not idle:
        return ""
    return ("- idle CPU just before each point, as a share of one core (median over the rounds): "
            + ", ".join(f"{k} {100 * float(np.median(v)):.1f}%" for k, v in idle.items()) + "\n")


def _latency(groups: dict[str, list[Record]], fig: Figures) -> str:
    lat = fig.latency
    if lat is None:
        return ""
    rows = _rows_by_round(groups.get("latency", []), fig, "round")
    return ("## Concurrency 1: the broker's price (alternating A B A B)\n\nvramguard (dynamic batching, batch 32, "
            "5 ms window, one worker) and the naive in-process endpoint, measured in turn, so that machine drift "
            "falls on both alike, each started for its own point and stopped after it.\n\n"
            f"{_idle_line(groups.get('latency', []))}"
            f"- p50 vramguard minus naive, min / median / max over {len(lat.deltas_ms)} rounds: "
            f"**{spread(lat.deltas_ms)} ms**\n\n" + table(SERVING_HEADERS, rows))


def _peer(groups: dict[str, list[Record]], fig: Figures) -> str:
    peer = fig.peer
    if peer is None:
        return ""
    rows = _rows_by_round(groups.get("peer", []), fig, "pair")
    return (f"## Side by side with LitServe (concurrency {peer.concurrency}, alternating A B A B)\n\nBoth servers "
            "run the same backend code (worker/models/minilm.py) with batch 32 and a 5 ms window. They are "
            "measured alternately, so that machine drift falls on both alike, and each is started for its own "
            "point and stopped after it, so that the idle one takes no CPU from the one measured.\n\n"
            f"{_idle_line(groups.get('peer', []))}"
            f"- throughput ratio vramguard / LitServe, min / median / max over {len(peer.rps_ratios)} pairs: "
            f"**{spread(peer.rps_ratios)}**\n- p99 ratio vramguard / LitServe (below 1 is better): "
            f"**{spread(peer.p99_ratios)}**\n\n" + table(SERVING_HEADERS, rows))


def _scale(groups: dict[str, list[Record]], fig: Figures) -> str:
    records = groups.get("scale", [])
    if not records:
        return ""
    def versus(r: Record) -> str | None:  # against 1 worker; a placement against 1 GPU x 1 worker
        base = fig.placed_rps.get((1, 1)) if "gpus" in r else fig.scale_rps.get(1) if "workers" in r else None
        return f"{float(r['rps']) / base:.2f}x" if base else None  # type: ignore[arg-type]

    rows = [[r["config"], r["concurrency"], r["rps"], versus(r),
             r["p50_ms"], r["p99_ms"], r.get("mean_batch"), r.get("queue_delay_ms"), r["requests"]] for r in records]
    return ("## Scale: synthetic workers (sleep-based forward: 40 ms per request, batch 1)\n\n"
            "Each worker serves at most 25 req/s; workers sleep instead of computing, so they do not compete for "
            "the cores. The `sim GPU` rows place the workers as `make up VRAMGUARD_SIM_GPUS=N WORKERS_PER_GPU=K` does "
            "(pinned, each with its share of its simulated GPU); their ratio is against 1 GPU x 1 worker. "
            "The last rows are the gateway's own ceiling: 2 instant workers (0 ms forward, batches up "
            "to 64), where only the gateway, Redis and the client do work.\n\n"
            + table(["configuration", "conc.", "req/s", "vs 1 worker", "p50 ms", "p99 ms", "mean batch",
                     "queue delay ms", "requests"], rows))


def _image(groups: dict[str, list[Record]]) -> str:
    records, limits = groups.get("image", []), groups.get("image-limit", [])
    if not records or not limits:
        return ""
    limit = max(limits, key=lambda r: float(r["items_per_s"]))  # type: ignore[arg-type]
    ceiling = float(limit["items_per_s"])  # type: ignore[arg-type]
    tried = ", ".join(f"batch {r['batch_size']}: {r['items_per_s']}" for r in limits)
    return ("## Image model: efficientnet (one 512x600 JPEG per request, base64 in JSON)\n\n"
            f"In-process ceiling (bench/image.py: decode + resize + forward + top-5 encode in one process, "
            f"{limit['torch_threads']} torch threads, the best batch size; {tried} items/s): **{ceiling} items/s** "
            f"(batch {limit['batch_size']}). '% of limit' is the served items/s over it.\n\n"
            + table(SERVING_HEADERS, serving_rows(records, ceiling)))


def _cost(groups: dict[str, list[Record]], fig: Figures) -> str:
    records = groups.get("cost", [])
    if not records or fig.cost is None:
        return ""
    rows: list[list[object]] = []
    for r in records:
        roles = dict(r["cpu_us_per_request"])  # type: ignore[call-overload]
        commands = dict(r.get("redis_commands_per_request") or {})  # type: ignore[call-overload]
        top = ", ".join(f"{k} {v}" for k, v in list(commands.items())[1:5])
        rows.append([r["pair"], r["config"], r["rps"], roles.get("gateway", roles.get("server")), roles.get("redis"),
                     roles.get("workers"), r["server_cpu_us_per_request"], commands.get("total"), top or None,
                     r["client_cpu_us_per_request"], r["answered"]])
    ratios = "".join(f"- {ours} / {other}, min / median / max over {len(v)} rounds: **{spread(v)}**\n"
                     for (ours, other), v in fig.cost.ratios_by_pair.items())
    return ("## Serving cost: CPU per request by process (concurrency 64, instant models)\n\n"
            "User + system CPU time of every server process (psutil) over a whole load point, divided by the "
            "requests answered in it: vramguard with one instant synthetic worker (0 ms forward, batches up to "
            f"64), a FastAPI endpoint that parses the same JSON and answers at once ({COST_BASELINE}, the floor), "
            "and LitServe with an instant model (when the peer venv is built), first echoing the text, then "
            "answering a 384-float32 row per input (minilm's reply), measured in turn round by round. Redis "
            "commands per request are INFO commandstats deltas over the same span (commands inside scripts "
            "counted one by one). CPU time per request moves far less with a busy machine than throughput does. "
            "The load client's own CPU is shown beside, not in the total.\n\n" + ratios + "\n"
            + table(["round", "configuration", "req/s", "gateway (or server) µs", "Redis µs", "workers µs",
                     "server total µs", "Redis cmds / req", "top commands / req", "load client µs", "requests"],
                    rows))


def _gateways(groups: dict[str, list[Record]], fig: Figures) -> str:
    records = groups.get("gateways", [])
    if not records:
        return ""
    rows = [[r["pair"], r["config"], r["concurrency"], r["rps"], r["p50_ms"], r["p99_ms"],
             dict(r["cpu_us_per_request"]).get("gateway"), r["server_cpu_us_per_request"],  # type: ignore[call-overload]
             r["client_cpu_us_per_request"], _busy(r)] for r in records]
    ceiling = f" The load client's own ceiling in this run: {fig.client_ceiling_rps} req/s." \
        if fig.client_ceiling_rps else ""
    return ("## Gateway scale-out (concurrency 64, 2 instant workers)\n\n"
            "1 and 2 gateway processes on one port (SO_REUSEPORT: the kernel spreads connections over them; "
            "each keeps its own reply stream), as `make up GATEWAYS=N` runs them, measured in turn round by "
            f"round.{ceiling}\n\n"
            + table(["round", "gateways", "conc.", "req/s", "p50 ms", "p99 ms", "gateway µs per request",
                     "server total µs", "load client µs", "cores busy: server + client / whole machine"], rows))


def _fairness(groups: dict[str, list[Record]]) -> str:
    records = groups.get("fairness", [])
    mixed = next((r for r in records if "bound_ms" in r), None)
    if mixed is None:
        return ""
    bulk = dict(mixed["bulk"])  # type: ignore[call-overload]
    verdict = "**met**" if mixed["met"] else "**missed**"
    rows = [[r["point"], r["requests"], r["p50_ms"], r["p99_ms"], r["max_ms"]] for r in records]
    rows.append([f"(the bulk requests beside it: {bulk['items_per_s']} items/s)", bulk["requests"], bulk["p50_ms"],
                 bulk["p99_ms"], None])
    return ("## Fairness under mixed load (1-input requests beside 256-input ones)\n\n"
            f"{mixed['config']}: the model sleeps a fixed time per forward whatever the batch size, as a GPU "
            "forward is nearly flat in batch size; one closed-loop client sends 1-input requests alone, then "
            "beside 4 clients of 256-input requests (bench/fairness.py). Requests larger than a batch are served "
            "in slices, so a small one rides in the next forward.\n\n"
            f"- 1-input p99 beside bulk <= p99 alone + one full-batch forward + window: {mixed['p99_ms']} ms vs "
            f"{mixed['p99_alone_ms']} + {mixed['full_forward_ms']} + {mixed['max_wait_ms']} = {mixed['bound_ms']} ms "
            f"({mixed['forwards']} forwards measured): {verdict}\n\n"
            + table(["point", "requests", "p50 ms", "p99 ms", "max ms"], rows))


def _busy(r: Record) -> str:
    return f"{r.get('cores_busy')} / {r.get('machine_cores_busy')} of {r.get('cores')}"
