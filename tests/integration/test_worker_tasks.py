"""The worker's long-lived tasks against a real Redis that misbehaves: a worker process talks to
Redis through a fault proxy (tests/proxy.py), the gateway directly. Every error redis-py can raise
(tests/redis_faults.py) is injected into each task: heartbeat, reclaim scan, clock sync and the
batch loop's reads; the worker goes on. A task that ends anyway makes the worker exit for a restart."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import RedisServer, Stack, wait_until
from tests.proxy import CUT, STALL, FaultProxy
from tests.redis_faults import all_faults
from vramguard.worker.runner import ExitCode
from vramguard.worker.tasks import MAX_UNEXPECTED_FAILURES

SETTINGS = {"served_models": "synthetic", "block_ms": 200, "heartbeat_interval_ms": 200,
            "heartbeat_ttl_ms": 1500, "reclaim_interval_ms": 200, "shutdown_grace_s": 5}


class PipelineFaultProxy(FaultProxy):
    """FaultProxy that also faults a pipeline, named by its first command (the heartbeat sends
    HSET, PEXPIRE and ZADD in one packet): an injected reply is written once per command in it,
    so the client reads as many replies as it sent commands."""

    def _commands(self, data: bytes) -> list[bytes]:
        import hiredis

        reader = hiredis.Reader()
        names: list[bytes] = []
        try:
            reader.feed(data)
            while (command := reader.gets()) is not False:
                if not isinstance(command, list) or not command:
                    return []
                names.append(bytes(command[0]).upper())
        except hiredis.ProtocolError:
            return []
        return names

    def _run(self) -> None:  # FaultProxy's, keeping the server to close its listening socket at the end
        asyncio.set_event_loop(self._loop)
        self.server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Close every connection on the proxy's loop first, so none is left for a later test's
        garbage collection to find open (an unraisable ResourceWarning there fails that test)."""
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(10)
        super().stop()

    async def _close_all(self) -> None:
        self.server.close()
        writers = list(getattr(self, "_open", ()))
        for writer in writers:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
        await asyncio.sleep(0.1)  # the proxy's tasks see their connections end and return

    async def _requests(self, reader: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                        up_w: asyncio.StreamWriter, delay: list[float]) -> None:
        if not hasattr(self, "_open"):
            self._open: set[asyncio.StreamWriter] = set()
        self._open.update((client_w, up_w))
        while data := await reader.read(65536):
            names = self._commands(data)
            faults = self._faults.get(names[0] if names else b"")
            if faults:
                fault = faults.pop(0)
                if fault == CUT:
                    return
                if fault == STALL:
                    await asyncio.sleep(self.stall_s)
                    return
                client_w.write(fault * len(names))
                continue
            for name in names:
                self.served[name] = self.served.get(name, 0) + 1
            up_w.write(data)
            await up_w.drain()


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    fault_proxy = PipelineFaultProxy(redis_server.port, stall_s=3.0).start()  # past the 2 s command timeout
    yield fault_proxy
    fault_proxy.stop()
    # Tasks left on its stopped loop (a stall still sleeping) and their sockets: end and collect
    # them now, not in a later test's garbage collection, where their ResourceWarnings (unraisable
    # with filterwarnings=error) would fail that test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        loop = fault_proxy._loop
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
        getattr(fault_proxy, "_open", set()).clear()
        gc.collect()


async def served(client: httpx.AsyncClient, value: int) -> bool:
    response = await client.post("/v1/models/synthetic/infer", json={"inputs": [value], "timeout_ms": 5000})
    return response.status_code == 200 and response.json()["outputs"] == [value]


@pytest.mark.slow
async def test_every_redis_error_in_every_long_lived_worker_task_is_survived(
    stack: Stack, proxy: FaultProxy
) -> None:
    """1. A gateway and one synthetic worker; the worker's Redis is behind the fault proxy.
    2. Each fault of tests/redis_faults.py (every error class of redis-py's table, a cut, a stall,
       garbage, replies of the wrong shape) is injected into the heartbeat (its pipeline), the
       reclaim scan (XPENDING) and the clock sync (TIME), and one at a time, between good reads,
       into the batch loop's read (XREADGROUP), with a request served after each.
    3. Then its read gets 10 replies of the wrong shape in a row.
    Result: the worker process still runs, answers every request, and beats and scans again after
    the last fault of 2; the clock sync, which runs every 5 s, has met at least its first three
    faults by then and the worker still runs. After 3 the worker drains and exits 9 (TASK_ENDED)
    for a restart. (Today a reply of the wrong shape to its read ends the worker with a traceback.)"""
    stack.settings.update(SETTINGS)
    stack.start_gateway()
    worker = stack.start_worker(environ={"VRAMGUARD_REDIS_URL": proxy.url}, model="synthetic")
    await stack.wait_ready(120)
    faults = all_faults()
    for command in (b"HSET", b"XPENDING", b"TIME"):
        proxy.inject(command, faults)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        for value, fault in enumerate(faults):
            before = proxy.served.get(b"XREADGROUP", 0)
            proxy.inject(b"XREADGROUP", [fault])
            try:
                await wait_until(lambda b=before: proxy.served.get(b"XREADGROUP", 0) > b, 30)  # type: ignore[misc]
            except AssertionError:
                raise AssertionError((value, fault, worker.poll(), stack.logs(60))) from None
            assert worker.poll() is None, (fault, stack.logs())
            assert await served(client, value), (fault, stack.logs())
        await wait_until(lambda: proxy.pending(b"HSET") == 0 and proxy.pending(b"XPENDING") == 0, 60)
        beats, scans = proxy.served.get(b"HSET", 0), proxy.served.get(b"XPENDING", 0)
        await wait_until(lambda: proxy.served.get(b"HSET", 0) > beats and proxy.served.get(b"XPENDING", 0) > scans, 10)
        # The clock syncs every 5 s: at least three of its faults have been met by now.
        await wait_until(lambda: proxy.pending(b"TIME") <= len(faults) - 3, 30)
        assert worker.poll() is None, stack.logs()
        assert await served(client, -1)
    # 3. A Redis that only ever answers the read unreadably: the worker gives up after 10 in a row.
    proxy.inject(b"XREADGROUP", [b"+OK\r\n"] * MAX_UNEXPECTED_FAILURES)
    await wait_until(lambda: worker.poll() is not None, 60, interval_s=0.2)
    assert worker.returncode == ExitCode.TASK_ENDED, stack.logs()


@pytest.mark.parametrize("name", ["heartbeat", "reclaim", "clock-sync", "hang-guard"])
async def test_a_long_lived_task_that_ends_makes_the_worker_exit_for_a_restart(start_worker, name: str) -> None:
    """1. An in-process synthetic worker on the real Redis is ready.
    2. One of its long-lived tasks ends (cancelled: no Redis error can end it any more).
    Result: the worker stops and returns ExitCode.TASK_ENDED (non-zero: its supervisor restarts it)."""
    handle = await start_worker(model="synthetic")
    assert name in handle.worker.tasks.watched
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == name]
    while not task.done():  # a cancel landing inside a redis-py call may be taken for a lost connection
        task.cancel()
        await asyncio.sleep(0.05)
    assert await asyncio.wait_for(handle.task, 30) == ExitCode.TASK_ENDED
