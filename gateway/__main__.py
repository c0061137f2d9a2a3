"""`python -m gateway`: read Settings from the environment, then serve with uvicorn."""

from __future__ import annotations

import sys

import uvicorn

from gateway.app import create_app
from shared.logs import configure_logging
from shared.settings import Settings, SettingsError


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"vramguard gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, "gateway")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        access_log=settings.access_log,
        log_config=None,  # keep our JSON handler
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 1,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
