"""In-process gateway (httpx.ASGITransport with its lifespan) and in-process workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from tests.helpers import wait_until
from vramguard.gateway.app import create_app
from vramguard.shared.settings import Settings
from vramguard.worker.models import create_backend
from vramguard.worker.runner import Worker


@pytest.fixture
async def gateway(settings_factory: Callable[..., Settings]) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client bound to an in-process gateway whose lifespan has run."""
    app = create_app(settings_factory())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


class WorkerHandle:
    """A Worker running as a task in the test's event loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.task: asyncio.Task[int] = asyncio.create_task(worker.run())

    async def stop(self) -> int:
        self.worker.should_exit = True
        return await asyncio.wait_for(self.task, 30)


@pytest.fixture
async def start_worker(settings_factory: Callable[..., Settings]) -> AsyncIterator[Callable[..., object]]:
    """Start in-process workers: `await start_worker(model="synthetic", **settings)`; waits until ready."""
    handles: list[WorkerHandle] = []

    async def start(**overrides: object) -> WorkerHandle:
        overrides.setdefault("model", "synthetic")
        overrides.setdefault("worker_name", f"inproc-{len(handles)}")
        settings = settings_factory(**overrides)
        backend = create_backend(settings, "sim" if settings.device == "sim" else "cpu")
        handle = WorkerHandle(Worker(settings, backend))
        handles.append(handle)
        await wait_until(lambda: handle.worker.stats.state == "ready" or handle.task.done(), 60)
        if handle.task.done():
            raise AssertionError(f"worker exited at start with {handle.task.result()}")
        return handle

    yield start
    for handle in handles:
        if not handle.task.done():
            await handle.stop()
