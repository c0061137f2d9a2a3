"""The generation suite's vLLM peer is launched as bench/services.py builds it; CI has no vLLM venv
(bench/.venv-vllm), so this checks the command, environment and URLs that the suite uses against it,
without starting it (tests/integration/test_bench_generate.py starts it where the venv is built), and
how the suite chooses its systems and shows a workload that failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import generate
from bench.generate_figures import section
from bench.generate_mixed import target_lengths
from bench.services import VLLM_PYTHON, vllm_cpu
from bench.suites import BenchConfig


def flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def test_vllm_runs_its_openai_server_module_from_its_own_venv(tmp_path: Path) -> None:
    folder = tmp_path / "smollm2-folder"
    service = vllm_cpu(tmp_path, model_folder=folder, served_name="smollm2", context_window=2048,
                       kv_cache_bytes=384 * 2**20, threads=1)
    # `python -m` the server module: the `vllm` command looks for a package named vllm, this one is vllm-cpu
    assert service.argv[:3] == [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    assert flags(service.argv) == {"--model": str(folder), "--served-model-name": "smollm2", "--host": "127.0.0.1",
                                   "--port": str(service.port), "--max-model-len": "2048", "--dtype": "float32",
                                   "--kv-cache-memory-bytes": str(384 * 2**20)}
    assert service.env["OMP_NUM_THREADS"] == "1" and service.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_the_suites_openai_client_reaches_vllms_routes(tmp_path: Path) -> None:
    service = vllm_cpu(tmp_path, model_folder=tmp_path, served_name="smollm2", context_window=2048,
                       kv_cache_bytes=2**30, threads=1)
    base = service.infer_url.removesuffix(service.path)  # what generate.served() hands the clients
    assert base == f"http://127.0.0.1:{service.port}"
    # openai's client posts to base + /v1/completions and /v1/chat/completions; readiness is vLLM's /health
    assert service.path == "/v1/completions" and service.health_path == "/health"


def test_mixed_prompt_sizes_span_16_to_1500_tokens_long_and_short_interleaved() -> None:
    sizes = target_lengths(32)
    assert sorted(sizes)[0] == 16 and sorted(sizes)[-1] == 1500 and len(set(sizes)) == 32
    assert sizes[:4] == [16, 1500, sorted(sizes)[1], sorted(sizes)[-2]]


def test_unknown_systems_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"unknown systems \['vllm'\]: choose from in-process, vramguard, vllm-cpu"):
        generate.systems(BenchConfig(out_dir=tmp_path, systems=("vramguard", "vllm")), generate.WORKLOAD)


def test_vllm_asked_for_by_name_without_its_venv_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate, "VLLM_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(RuntimeError, match=r"vllm-cpu: no venv at .*no-venv: `make bench` builds it"):
        generate.systems(BenchConfig(out_dir=tmp_path, systems=("vllm-cpu",)), generate.WORKLOAD)


def test_a_failed_mixed_workload_shows_its_error_in_place_of_figures() -> None:
    record = {"suite": "generate", "config": "vramguard", "pair": 0, "workload": "mixed", "concurrency": 32,
              "torch_threads": 1, "error": "APIError: the generation did not finish before its deadline",
              "pool_tokens": 15430}
    text = section([record])
    assert "| 0 | vramguard | 32 | failed: APIError: the generation did not finish before its deadline | — |" in text
