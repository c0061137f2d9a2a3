"""Fixtures shared by every test folder. Tests are marked by folder (unit, integration,
chaos, gpu), LitServe's convention; integration tests get a real redis-server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from tests.ci import require_part
from tests.helpers import RedisServer, Stack
from vramguard.shared.settings import Settings

MIN_REDIS = (6, 2)

FOLDER_MARKS = {"unit": "unit", "deploy": "unit", "integration": "integration", "chaos": "chaos", "gpu": "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(getattr(pytest.mark, FOLDER_MARKS[folder]))
        if folder == "chaos":
            item.add_marker(pytest.mark.slow)


# Under pytest-xdist (`make test-all` runs two test processes) each module is one unit of work, so
# that its fixtures (a stack, a loaded model) start once. One unit, "serial", runs its modules one
# after another in a single test process: the chaos scenarios and the other modules whose bounds
# are seconds under load (tests.helpers.load_slack: a 4xx within 1 s of its first byte, measured
# with a niced helper, took 2 s beside a generating model), and the modules that keep a core busy
# for a minute or more (real models generating or restarting, random placements, several workers
# under load), so that no two of those overlap. Beside them the other process runs the rest, which
# mostly waits on processes, sockets and timers: the whole suite in one process used about one core
# of two.
SERIAL_MODULES = {
    # bounds of seconds, scaled by load_slack
    "test_event_loop_bound.py", "test_http_server.py", "test_worker_alive.py",
    # a core busy for a minute or more
    "test_generate_memory.py", "test_generate_metrics.py", "test_generate_pool.py", "test_generate_smollm2_pool.py",
    "test_make_up_gpus.py", "test_memory_minilm_restarts.py", "test_memory_placements.py",
    "test_memory_placements_real.py", "test_memory_restart.py", "test_model_folder.py",
}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under pytest-xdist: "serial", or its module's path."""
    path = nodeid.split("::", 1)[0]
    return "serial" if path.startswith("tests/chaos/") or path.rsplit("/", 1)[-1] in SERIAL_MODULES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's load-scope scheduler with `work_unit` as the scope (its own `--dist loadgroup` reads
    groups from test ids, which pytest-asyncio's test items do not carry)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (persistence off, free port)."""
    server = RedisServer()
    server.start()
    with redis.Redis(port=server.port) as client:
        version = client.info("server")["redis_version"]
    if tuple(int(p) for p in str(version).split(".")[:2]) < MIN_REDIS:  # XAUTOCLAIM, XPENDING IDLE
        server.stop()
        require_part(False, f"redis-server {version} is older than {MIN_REDIS}")
    yield server
    server.stop()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A client on the session's Redis; the database is flushed after each test."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.flushdb()
    await client.aclose()


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fast_settings(redis_server: RedisServer, key_prefix: str) -> dict[str, object]:
    """Settings values that make tests quick: short blocks and heartbeats, both models served."""
    return {
        "redis_url": redis_server.url,
        "key_prefix": key_prefix,
        "served_models": "minilm,synthetic",
        "block_ms": 200,
        "heartbeat_interval_ms": 200,
        "heartbeat_ttl_ms": 1500,
        "shutdown_grace_s": 5,
    }


@pytest.fixture
def settings_factory(fast_settings: dict[str, object]):  # type: ignore[no-untyped-def]
    """Build a Settings from fast_settings plus overrides (constructed, never via os.environ)."""

    def make(**overrides: object) -> Settings:
        values = {**fast_settings, **overrides}
        if isinstance(values.get("served_models"), str):
            values["served_models"] = str(values["served_models"]).split(",")
        return Settings(**values)  # type: ignore[arg-type]

    return make


@pytest.fixture
def stack(redis_server: RedisServer, fast_settings: dict[str, object], tmp_path: Path) -> Iterator[Stack]:
    """Gateway and workers as real processes on the session's Redis; stopped after the test."""
    values = {k: v for k, v in fast_settings.items() if k != "redis_url"}
    s = Stack(redis_server.url, tmp_path, **values)
    yield s
    s.stop()
