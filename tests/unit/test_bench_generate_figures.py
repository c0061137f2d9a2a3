"""bench/generate_figures.py: the generation targets' verdicts and RESULTS.md section from a run's records."""

from __future__ import annotations

import pytest

from bench.generate_figures import per_round, section, verdict_rows


def records() -> list[dict[str, object]]:
    """Two rounds of the four systems at c=1 and c=32 (tokens/s, TTFT ms per system)."""
    figures = {  # round -> concurrency -> system -> (tokens/s, ttft ms)
        0: {1: {"in-process": (20.0, 50.0), "vramguard": (18.0, 58.0), "naive": (19.0, 800.0),
                "litserve": (17.0, 70.0)},
            32: {"in-process": (100.0, 900.0), "vramguard": (72.0, 950.0), "naive": (20.0, 9000.0),
                 "litserve": (18.0, 4000.0)}},
        1: {1: {"in-process": (20.0, 50.0), "vramguard": (18.0, 64.0), "naive": (19.0, 800.0),
                "litserve": (17.0, 70.0)},
            32: {"in-process": (100.0, 900.0), "vramguard": (66.0, 950.0), "naive": (24.0, 9000.0),
                 "litserve": (18.0, 4000.0)}},
    }
    return [{"suite": "generate", "config": system, "pair": round_, "concurrency": c, "max_tokens": 16,
             "torch_threads": 1, "tokens_per_s": tps, "ttft_median_ms": ttft, "tokens": 16 * c}
            for round_, points in figures.items() for c, systems in points.items()
            for system, (tps, ttft) in systems.items()]


def test_ratios_are_per_round_and_verdicts_use_their_median() -> None:
    run = records()
    assert per_round(run, 32, "tokens_per_s", "vramguard", "naive", "/") == pytest.approx([3.6, 2.75])
    assert per_round(run, 1, "ttft_median_ms", "vramguard", "in-process", "-") == pytest.approx([8.0, 14.0])
    rows = {row[0]: row[1:] for row in verdict_rows(run)}
    # median of 3.6 and 2.75 = 3.175 >= 3; median of 0.72 and 0.66 = 0.69 < 0.7; median of +8 and +14 = +11 > 10
    assert rows["tokens/s at c=32 >= 3x the naive endpoint's"] == [
        "3.17x (min/med/max 2.75 / 3.17 / 3.60 over 2 rounds)", "**met**"]
    assert rows["tokens/s at c=32 >= 0.7 of the in-process engine's"] == [
        "0.69x (min/med/max 0.66 / 0.69 / 0.72 over 2 rounds)", "**missed**"]
    assert rows["time to first token at c=1 <= the in-process figure + 10 ms"] == [
        "+11.0 ms (min/med/max 8.00 / 11.00 / 14.00 ms over 2 rounds)", "**missed**"]


def test_a_round_missing_a_system_is_left_out() -> None:
    run = [r for r in records() if not (r["pair"] == 1 and r["config"] == "naive")]
    assert per_round(run, 32, "tokens_per_s", "vramguard", "naive", "/") == pytest.approx([3.6])
    assert verdict_rows([]) == [] and section([]) == ""


def test_section_renders_verdicts_medians_and_every_point() -> None:
    text = section(records())
    assert text.startswith("## Text generation: SmolLM2-135M (greedy, 16 tokens per request, 1 torch thread)")
    assert "| tokens/s at c=32 >= 3x the naive endpoint's | 3.17x" in text
    assert "| vramguard | 32 | 69.0 | 950.0 | 2 |" in text  # median of 72 and 66 tokens/s over the rounds
    assert "| 1 | naive | 32 | 24.0 | 9000.0 | 512 |" in text
    assert text.count("\n| ") == 3 + 8 + 16 + 3  # three verdicts, 8 medians, 16 points, 3 header rows
