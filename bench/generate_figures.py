"""The generation suite's figures, verdicts and RESULTS.md section, from its records
({"suite": "generate", "config", "pair", "concurrency", "tokens_per_s", "ttft_median_ms", ...}).

Targets, each a median over the rounds of a per-round figure (the four systems of a round are
measured back to back, so machine drift falls on them alike):
- at concurrency 32, vramguard's tokens/s >= 3x the naive endpoint's;
- at concurrency 32, vramguard's tokens/s >= 0.7 of the in-process engine's;
- at concurrency 1, vramguard's time to first token <= the in-process figure + 10 ms.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

Record = dict[str, object]
SYSTEMS = ("in-process", "vramguard", "naive", "litserve")
TOP, ONE = 32, 1
NAIVE_RATIO, LIMIT_SHARE, TTFT_SLACK_MS = 3.0, 0.7, 10.0


def by_round(records: list[Record], concurrency: int, field: str) -> dict[int, dict[str, float]]:
    """{round: {system: figure}} for one concurrency and one field (e.g. tokens_per_s)."""
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r["concurrency"] == concurrency:
            rounds[int(r["pair"])][str(r["config"])] = float(r[field])  # type: ignore[call-overload, arg-type]
    return rounds


def per_round(records: list[Record], concurrency: int, field: str, ours: str, base: str,
              op: str) -> list[float]:
    """`ours` / `base` (op "/") or `ours` - `base` (op "-") in each round that has both."""
    values = []
    for figures in by_round(records, concurrency, field).values():
        if ours in figures and base in figures and (op == "-" or figures[base] > 0):
            values.append(figures[ours] / figures[base] if op == "/" else figures[ours] - figures[base])
    return values


def _spread(values: list[float], unit: str = "") -> str:
    lo, mid, hi = np.min(values), np.median(values), np.max(values)
    return f"min/med/max {lo:.2f} / {mid:.2f} / {hi:.2f}{unit} over {len(values)} rounds"


def verdict_rows(records: list[Record]) -> list[list[object]]:
    """[target, measured, verdict] for the three targets that the records allow (none without rounds)."""
    rows: list[list[object]] = []
    for base, need, label in (("naive", NAIVE_RATIO, f"tokens/s at c={TOP} >= {NAIVE_RATIO:g}x the naive endpoint's"),
                              ("in-process", LIMIT_SHARE,
                               f"tokens/s at c={TOP} >= {LIMIT_SHARE:g} of the in-process engine's")):
        ratios = per_round(records, TOP, "tokens_per_s", "vramguard", base, "/")
        if ratios:
            mid = float(np.median(ratios))
            rows.append([label, f"{mid:.2f}x ({_spread(ratios)})", "**met**" if mid >= need else "**missed**"])
    deltas = per_round(records, ONE, "ttft_median_ms", "vramguard", "in-process", "-")
    if deltas:
        mid = float(np.median(deltas))
        rows.append([f"time to first token at c={ONE} <= the in-process figure + {TTFT_SLACK_MS:g} ms",
                     f"{mid:+.1f} ms ({_spread(deltas, ' ms')})", "**met**" if mid <= TTFT_SLACK_MS else "**missed**"])
    return rows


def table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join("—" if v is None else str(v) for v in row) + " |" for row in rows])


def section(records: list[Record]) -> str:
    """The RESULTS.md section: verdicts, then the medians over rounds and every point; '' without records."""
    if not records:
        return ""
    first = records[0]
    medians: list[list[object]] = []
    for concurrency in sorted({int(r["concurrency"]) for r in records}):  # type: ignore[call-overload]
        for system in SYSTEMS:
            points = [r for r in records if r["concurrency"] == concurrency and r["config"] == system]
            if points:
                medians.append([system, concurrency,
                                round(float(np.median([float(p["tokens_per_s"]) for p in points])), 1),  # type: ignore[arg-type]
                                round(float(np.median([float(p["ttft_median_ms"]) for p in points])), 1),  # type: ignore[arg-type]
                                len(points)])
    rows = [[r["pair"], r["config"], r["concurrency"], r["tokens_per_s"], r["ttft_median_ms"], r["tokens"]]
            for r in records]
    return ("## Text generation: SmolLM2-135M (greedy, "
            f"{first['max_tokens']} tokens per request, {first['torch_threads']} torch thread)\n\n"
            "`python -m bench generate` (bench/generate.py): in-process = the worker's engine "
            "(worker/generate/engine.py) with all sequences admitted at once, no HTTP and no Redis; vramguard = "
            "gateway + Redis + one worker, streamed OpenAI completions; naive = a FastAPI endpoint running "
            "`generate` per request, not streamed (its time to first token is the whole reply's); litserve = "
            "LitServe with `stream=True`, the same engine for one sequence per request. Each round measures the "
            "four in turn, each started for its own points and stopped after them. Time to first token is the "
            "median over the requests of a point.\n\n"
            + table(["target", "measured", "verdict"], verdict_rows(records)) + "\n\n"
            + table(["system", "conc.", "tokens/s (median over rounds)", "TTFT ms (median over rounds)", "rounds"],
                    medians) + "\n\n"
            + table(["round", "system", "conc.", "tokens/s", "TTFT median ms", "tokens"], rows))
