"""In-process gateway (httpx.ASGITransport with its lifespan) and in-process workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest

from tests.helpers import RedisServer, Stack, wait_until
from tests.proxy import FaultProxy
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


# One gateway process and its workers, shared by the modules that test the gateway's edges
# (test_event_loop_bound.py, test_gateway_tasks.py): the gateway reaches Redis through a fault
# proxy (tests/proxy.py), the workers directly.
EDGE_PREFIX = "edge"
EDGE_SETTINGS = {"key_prefix": EDGE_PREFIX, "served_models": "minilm,synthetic,flags,counts,broken", "block_ms": 200,
                 "heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1500, "shutdown_grace_s": 5,
                 "models__synthetic__queue_bound_bytes": 10 * 2**20, "max_inflight_body_bytes": 20 * 2**20}
EDGE_MODELS_FILE = """
[flags]
backend = "vramguard.worker.models.synthetic:SyntheticBackend"
description = "synthetic, seen by KServe v2 as BOOL in and out"
input_kind = "json"
output = { kind = "json" }
inputs = [{ name = "flags", datatype = "BOOL", shape = [-1] }]
outputs = [{ name = "flags", datatype = "BOOL", shape = [-1] }]
example = [true, false]

[counts]
backend = "vramguard.worker.models.synthetic:SyntheticBackend"
description = "synthetic, seen by KServe v2 as INT32 in and out"
input_kind = "json"
output = { kind = "json" }
inputs = [{ name = "counts", datatype = "INT32", shape = [-1] }]
outputs = [{ name = "counts", datatype = "INT32", shape = [-1] }]
example = [1, 2]

[broken]
backend = "no_such_package.serving:Missing"
description = "a plug-in that cannot start: its package is not installed"
input_kind = "json"
output = { kind = "json" }
"""
INSTANT = '{"batch_ms": 0, "item_ms": 0}'


@pytest.fixture(scope="session")
def edge_proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(redis_server.port).start()
    yield fault_proxy
    fault_proxy.stop()


@pytest.fixture(scope="session")
def edge_stack(redis_server: RedisServer, edge_proxy: FaultProxy,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway through `edge_proxy` serving minilm (no worker: its requests stop at admission),
    synthetic and flags (a worker each, instant), counts (no worker) and broken (whose workers cannot
    start); models file EDGE_MODELS_FILE."""
    folder = tmp_path_factory.mktemp("edge")
    models_file = folder / "models.toml"
    models_file.write_text(EDGE_MODELS_FILE)
    stack = Stack(redis_server.url, folder, models_file=models_file, **EDGE_SETTINGS)
    try:  # stopped also when it never gets ready: no process outlives the session
        stack.start_gateway(environ={"VRAMGUARD_REDIS_URL": edge_proxy.url})
        stack.start_worker(model="synthetic", models__synthetic__params=INSTANT)
        stack.start_worker(model="flags", models__flags__params=INSTANT)
        asyncio.run(stack.wait_ready(120))
        yield stack
    finally:
        stack.stop()
