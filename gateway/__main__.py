"""`python -m vramguard.gateway`: read Settings from the environment, then serve with uvicorn.

The HTTP front of vramguard: validates requests, queues them on Redis Streams for the workers and
answers with their results. It takes no arguments: every setting is a VRAMGUARD_* environment
variable (listed below). `make up` starts it under supervisor with the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from vramguard.gateway.app import broken_task, create_app, fail_waiting, shut_down
from vramguard.gateway.collector import tune_for_serving
from vramguard.gateway.edge.server import shared_port_socket, uvicorn_options
from vramguard.shared.logs import configure_logging
from vramguard.shared.settings import Settings, SettingsError, settings_help
from vramguard.shared.tracing import TracingError, configure_tracing


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m vramguard.gateway", description=__doc__, epilog=settings_help(),
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"vramguard gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, "gateway")
    try:
        configure_tracing("vramguard-gateway")  # only when an OTLP endpoint is set (OTEL_* variables)
    except TracingError as exc:
        print(f"vramguard gateway: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        access_log=settings.access_log,
        log_config=None,  # keep our JSON handler
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 1,
        **uvicorn_options(settings),  # type: ignore[arg-type]
    )
    listener = shared_port_socket(settings) if settings.reuse_port else None
    DrainingServer(config, app, on_started=tune_for_serving).run(sockets=[listener] if listener is not None else None)
    # A gateway whose long-lived task ended exits non-zero, so supervisor and Kubernetes restart it.
    return 1 if broken_task(app) is not None else 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown: the first SIGTERM flips readiness
    to 503, serves on for shutdown_delay_s, then lets requests in flight finish (app.shut_down)
    while the port still answers, so a load balancer sees "not ready" rather than a refused
    connection or a 503; then uvicorn shuts down as usual. A second signal exits at once
    (uvicorn's behaviour). A long-lived task that ended (app.broken_task) fails the waiting
    requests and exits at once."""

    def __init__(self, config: uvicorn.Config, app: object, *, on_started: Callable[[], None] | None = None) -> None:
        """`on_started`: called once uvicorn's startup (the app's lifespan included) is done."""
        super().__init__(config)
        self._on_started = on_started
        self._app = app
        self._drain: asyncio.Task[None] | None = None
        self._drain_requested = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        self._drain_requested = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._on_started is not None:
            self._on_started()

    async def on_tick(self, counter: int) -> bool:
        if self._drain is None and broken_task(self._app) is not None:  # type: ignore[arg-type]
            fail_waiting(self._app)  # type: ignore[arg-type]
            self.should_exit = True
        if self._drain_requested and self._drain is None:
            self._drain = asyncio.create_task(shut_down(self._app))  # type: ignore[arg-type]
        if self._drain is not None and self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)


if __name__ == "__main__":
    sys.exit(main())
