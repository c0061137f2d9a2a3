"""Placement: GPUS values, placement files, and the shares each worker plans from
(deploy/placement.py, deploy/programs.py), and `deploy/up.py` refusing a bad one (exit 2)
before anything starts."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port
from vramguard.cli.placement import (
    Gpu,
    ModelPlacement,
    PlacementError,
    WorkerGroup,
    gpus_from_nvidia_smi,
    load_placement,
    plan,
    select_gpus,
    simulated_gpus,
)
from vramguard.cli.programs import render_programs, worker_environment
from vramguard.shared.settings import Settings

SMI = "0, GPU-3f2a6c1e-aaaa-bbbb-cccc-000000000000\n1, GPU-9b7d0e42-aaaa-bbbb-cccc-111111111111\n"


def up(tmp_path: Path, *args: str, sim_gpus: int = 2) -> subprocess.CompletedProcess[str]:
    """Run deploy/up.py for real; a refusal must come before supervisord starts (no run dir)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(VRAMGUARD_SIM_GPUS=str(sim_gpus), VRAMGUARD_PORT=str(port), VRAMGUARD_REDIS_PORT=str(free_port()))
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "up.py"), "--run-dir", str(run_dir), *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert not run_dir.exists(), "something started"
    return done


def shares_by_gpu(groups: list[WorkerGroup]) -> dict[int, float]:
    out: dict[int, float] = {}
    for g in groups:
        assert g.gpu is not None and g.share is not None
        out[g.gpu.index] = out.get(g.gpu.index, 0.0) + g.share * g.workers
    return out


def test_an_overcommitted_placement_is_refused_with_exit_2_naming_the_gpu(tmp_path: Path) -> None:
    placement = tmp_path / "p.toml"
    placement.write_text('[[model]]\nname = "minilm"\ngpus = [0, 1]\nworkers = 2\nshare = 0.5\n\n'
                         '[[model]]\nname = "synthetic"\ngpus = [1]\nshare = 0.4\n')
    done = up(tmp_path, "--placement", str(placement))
    assert done.returncode == 2, done
    assert "GPU 1: shares add up to 0.9 (minilm 0.5 + synthetic 0.4), more than the watermark 0.8" in done.stderr


@pytest.mark.parametrize(("gpus", "message"), [
    ("0,2", "--gpus=0,2: no GPU '2' on this host (GPUs: 0, 1)"),
    ("1,1", "--gpus=1,1: GPU '1' is named twice"),
    ("0,", "--gpus=0,: empty GPU name"),
])
def test_a_bad_gpus_value_stops_make_up_with_exit_2_naming_it(tmp_path: Path, gpus: str, message: str) -> None:
    done = up(tmp_path, "--model", "synthetic", "--gpus", gpus)
    assert done.returncode == 2, done
    assert message in done.stderr


def test_a_real_model_on_simulated_gpus_is_placed_by_check(tmp_path: Path) -> None:
    """minilm runs on simulated GPUs (on the CPU, its allocations mirrored into the simulated
    allocator: worker/memory/mirror.py), so `check` places it there instead of refusing it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update(VRAMGUARD_SIM_GPUS="2", VRAMGUARD_PORT=str(free_port()), VRAMGUARD_REDIS_PORT=str(free_port()))
    checked = subprocess.run([sys.executable, "-m", "vramguard.cli", "check", "--model", "minilm"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "cannot run on simulated GPUs" not in checked.stderr, checked
    assert "2 simulated (VRAMGUARD_SIM_GPUS)" in checked.stdout and "nvidia-smi" not in checked.stdout, checked
    assert "worker-minilm-gpu1: 1 x minilm on GPU 1" in checked.stdout, checked.stdout


def test_gpus_on_a_host_without_gpus_is_refused(tmp_path: Path) -> None:
    done = up(tmp_path, "--gpus", "0", sim_gpus=0)
    assert done.returncode == 2 and "this host has no GPUs" in done.stderr


def test_gpus_by_uuid_and_a_gpu_named_by_index_and_uuid_counts_twice() -> None:
    gpus = gpus_from_nvidia_smi(SMI)
    assert [g.index for g in gpus] == [0, 1] and gpus[1].visible_id.startswith("GPU-9b7d0e42")
    assert select_gpus("GPU-9b7d0e42-aaaa-bbbb-cccc-111111111111", gpus) == [gpus[1]]
    assert select_gpus("all", gpus) == gpus
    with pytest.raises(PlacementError, match="named twice"):
        select_gpus(f"1,{gpus[1].visible_id}", gpus)


def test_the_old_way_three_workers_on_one_device_get_shares_that_add_up() -> None:
    """WORKERS=3 and no per-GPU setting: three workers each planning for the whole device is
    impossible by construction: each gets a third of the watermark and knows there are three."""
    for available in (simulated_gpus(1), []):
        (group,) = plan([ModelPlacement(name="synthetic", workers=3)], available, watermark=0.8)
        assert group.workers == 3 and group.workers_on_device == 3
        env = {k: v.replace("%(host_node_name)s", "h").replace("%(process_num)d", "0")
               for k, v in worker_environment(group).items()}
        settings = Settings(**{k.removeprefix("VRAMGUARD_").lower(): v for k, v in env.items()
                               if k.startswith("VRAMGUARD_")})
        share = settings.memory_share or settings.watermark / settings.workers_per_gpu
        assert 3 * share <= 0.8
        assert ("CUDA_VISIBLE_DEVICES" in env) == bool(available)


def test_the_example_placement_and_models_without_a_share_split_what_is_left() -> None:
    groups = plan(load_placement(ROOT / "deploy" / "placement.example.toml"), simulated_gpus(2), 0.8)
    assert [(g.program, g.workers, g.workers_on_device, g.share) for g in groups] == [
        ("worker-minilm-gpu0", 2, 2, 0.2), ("worker-minilm-gpu1", 2, 3, 0.2), ("worker-synthetic-gpu1", 1, 3, 0.4)]
    assert shares_by_gpu(groups) == {0: 0.4, 1: 0.8}
    mixed = plan([ModelPlacement(name="minilm", share=0.5, workers=2), ModelPlacement(name="synthetic", workers=3)],
                 simulated_gpus(1), 0.8)
    assert [g.share for g in mixed] == [0.25, 0.1]
    assert shares_by_gpu(mixed)[0] <= 0.8


def test_one_model_with_other_workers_on_other_gpus() -> None:
    """3 workers on GPU 0 and 2 on GPU 1: two tables of one model; each GPU's shares add up."""
    groups = plan([ModelPlacement(name="synthetic", gpus=[0], workers=3),
                   ModelPlacement(name="synthetic", gpus=[1], workers=2)], simulated_gpus(2), 0.8)
    assert [(g.program, g.workers, g.workers_on_device) for g in groups] == [
        ("worker-synthetic-gpu0", 3, 3), ("worker-synthetic-gpu1", 2, 2)]
    assert all(total <= 0.8 for total in shares_by_gpu(groups).values())


def test_a_share_above_the_watermark_is_refused_by_the_worker_settings() -> None:
    with pytest.raises(ValueError, match=r"memory_share \(0.9\) must not exceed (the )?watermark \(0.8\)"):
        Settings(memory_share=0.9)


def test_two_stacks_on_two_ports_get_their_own_run_dir_and_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramguard.cli.main import build_parser
    from vramguard.cli.up import build_env

    groups = plan([ModelPlacement(name="synthetic")], [], 0.8)
    monkeypatch.setenv("VRAMGUARD_REDIS_URL", "redis://127.0.0.1:1/0")  # an existing Redis: none started
    run_dirs = set()
    for port in sorted({free_port() for _ in range(5)})[:2]:
        monkeypatch.setenv("VRAMGUARD_PORT", str(port))
        run_dirs.add(build_env(build_parser().parse_args(["up"]), groups)["VG_RUN_DIR"])
    assert len(run_dirs) == 2
    conf = configparser.RawConfigParser(interpolation=None)
    conf.read(ROOT / "deploy" / "supervisord.conf")
    assert conf["unix_http_server"]["file"].startswith("%(ENV_VG_RUN_DIR)s/")
    assert conf["supervisord"]["pidfile"].startswith("%(ENV_VG_RUN_DIR)s/")


def test_no_room_left_for_a_model_without_a_share_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"GPU 0: minilm 0.8 take the whole watermark 0.8; nothing left for"):
        plan([ModelPlacement(name="minilm", share=0.8), ModelPlacement(name="synthetic")], simulated_gpus(1), 0.8)


@pytest.mark.parametrize(("text", "message"), [
    ('[[model]]\nname = "nope"\n', "unknown model 'nope'"),
    ('[[model]]\nname = "minilm"\nshares = 0.5\n', "model.0.shares: Extra inputs are not permitted"),
    ('[[model]]\nname = "minilm"\n[[model]]\nname = "minilm"\ngpus = [1]\n',
     "GPU 1: model 'minilm' is placed there twice"),
    ('[[model]\n', "not TOML"),
    ('[[model]]\nname = "minilm"\ngpus = [0, 7]\n', "minilm.gpus=0,7: no GPU '7'"),
])
def test_a_bad_placement_file_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PlacementError, match=message.replace(".", r"\.").replace("[", r"\[")):
        plan(load_placement(path), simulated_gpus(2), 0.8)


def test_a_placement_names_models_of_the_models_file_only_when_that_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[[model]]\nname = "tiny"\n')
    with pytest.raises(PlacementError, match="unknown model 'tiny'"):
        load_placement(path)  # the built-in models only
    models_file = ROOT / "examples" / "tiny_classifier" / "models.toml"
    catalogue = Settings(models_file=str(models_file)).catalogue
    assert [g.model for g in plan(load_placement(path, known=catalogue), simulated_gpus(1), 0.8)] == ["tiny"]


def test_an_unknown_model_is_refused_with_exit_2_naming_the_known_ones(tmp_path: Path) -> None:
    done = up(tmp_path, "--model", "tiny")  # no VRAMGUARD_MODELS_FILE: only the built-in models
    assert done.returncode == 2, done
    assert "--model 'tiny' is not a known model; known: efficientnet, minilm, smollm2, synthetic" in done.stderr
    assert "VRAMGUARD_MODELS_FILE" in done.stderr


def test_each_group_becomes_one_program_with_the_shipped_worker_settings() -> None:
    groups = plan([ModelPlacement(name="minilm", workers=2)], [Gpu(0, "GPU-a"), Gpu(1, "GPU-b")], 0.8)
    parser = configparser.RawConfigParser(interpolation=None)
    parser.read_string(render_programs(groups))
    assert parser.sections() == ["program:worker-minilm-gpu0", "program:worker-minilm-gpu1"]
    program = parser["program:worker-minilm-gpu1"]
    assert program["numprocs"] == "2" and program["autorestart"] == "true" and program["stopwaitsecs"] == "20"
    assert 'CUDA_VISIBLE_DEVICES="GPU-b"' in program["environment"]
    assert 'VRAMGUARD_MEMORY_SHARE="0.400000"' in program["environment"]
    assert 'VRAMGUARD_WORKER_NAME="%(host_node_name)s-minilm-gpu1-%(process_num)d"' in program["environment"]


def test_in_a_container_worker_output_goes_to_supervisors_stdout() -> None:
    """--workers-only (the worker image): Docker's log driver collects and rotates the output."""
    groups = plan([ModelPlacement(name="minilm")], [Gpu(0, "GPU-a")], 0.8)
    parser = configparser.RawConfigParser(interpolation=None)
    parser.read_string(render_programs(groups, log_to_stdout=True))
    program = parser["program:worker-minilm-gpu0"]
    assert program["stdout_logfile"] == "/dev/stdout" and program["stdout_logfile_maxbytes"] == "0"
