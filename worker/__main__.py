"""`python -m vramguard.worker`: read Settings, build the model backend, run the Worker, exit with its code.

One worker process serves one model (VRAMGUARD_MODEL) on one device (CUDA_VISIBLE_DEVICES pins it
to one GPU): it reads batches from the model's Redis stream, runs them inside its memory budget
and publishes the results. It takes no arguments: every setting is a VRAMGUARD_* environment
variable (listed below). `make up` starts workers under supervisor, which restarts one that exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from vramguard.shared import eventloop
from vramguard.shared.logs import configure_logging
from vramguard.shared.settings import Settings, SettingsError, settings_help
from vramguard.shared.tracing import TracingError, configure_tracing
from vramguard.worker.exitcode import ExitCode
from vramguard.worker.health.startfail import report_start_failure
from vramguard.worker.models import BackendContractError
from vramguard.worker.runner import Worker  # no torch import: cheap enough for --help


def exit_codes_help() -> str:
    """The exit codes, one per line (supervisor restarts a worker on any but 0)."""
    return "exit codes:\n" + "\n".join(f"  {code.value}  {code.name}" for code in ExitCode)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m vramguard.worker", description=__doc__,
                            epilog=f"{exit_codes_help()}\n\n{settings_help()}",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"vramguard worker: {exc}", file=sys.stderr)
        return ExitCode.INVALID_SETTINGS
    if settings.cuda_visible_devices and "," in settings.cuda_visible_devices:
        # One process = one model on one device: its memory share is of one GPU.
        print(f"vramguard worker: CUDA_VISIBLE_DEVICES={settings.cuda_visible_devices!r} names several GPUs; "
              "pin each worker to one (make up and the compose file do)", file=sys.stderr)
        return ExitCode.INVALID_SETTINGS
    configure_logging(settings.log_level, "worker")  # before the model's imports, which log
    try:
        configure_tracing("vramguard-worker")  # only when an OTLP endpoint is set (OTEL_* variables)
    except TracingError as exc:
        print(f"vramguard worker: {exc}", file=sys.stderr)
        return ExitCode.INVALID_SETTINGS
    try:
        backend = build_backend(settings)
    except BackendContractError as exc:  # the user's to fix; no traceback, the message says what
        logging.getLogger("worker").error("model is not servable", extra={"error": str(exc)})
        print(f"vramguard worker: {exc}", file=sys.stderr)
        asyncio.run(report_start_failure(settings, ExitCode.MODEL_INVALID, str(exc)))
        return ExitCode.MODEL_INVALID
    except Exception as exc:
        logging.getLogger("worker").exception("model failed to load", extra={"error": f"{type(exc).__name__}: {exc}"})
        asyncio.run(report_start_failure(settings, ExitCode.STARTUP_FAILED, f"{type(exc).__name__}: {exc}"))
        return ExitCode.STARTUP_FAILED

    async def _main() -> int:
        worker = Worker(settings, backend)
        worker.install_signal_handlers()
        code = await worker.run()
        if code in (ExitCode.STARTUP_FAILED, ExitCode.MODEL_INVALID) and worker.stats.state != "ready":
            await report_start_failure(settings, code, worker.start_error or f"{code.name}; see the worker's log")
        return code

    code = eventloop.run(_main(), settings.event_loop)
    if code == ExitCode.CUDA_CONTEXT_LOST:
        # Leave at once: no atexit hooks or thread joins that could touch a broken CUDA context
        # (the process exit is what frees its device memory).
        logging.shutdown()
        os._exit(code)
    return code


def build_backend(settings: Settings):  # type: ignore[no-untyped-def]
    """The backend for settings.model on settings.device, torch threads set; not loaded yet."""
    import torch

    from vramguard.worker.backend import resolve_device
    from vramguard.worker.models import create_backend

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    return create_backend(settings, resolve_device(settings.device))


if __name__ == "__main__":
    sys.exit(main())
