"""A TCP proxy in front of Redis that loses replies: after a client sends a command containing
`marker` (by default EVALSHA: the scripts that must not run twice), the proxy lets the command
reach Redis, then cuts the connection instead of delivering the reply of every `every`-th
distinct such command, or holds it for `delay_s` (longer than the client's socket timeout).
Either way the command ran and redis-py re-sends it, byte for byte, on a new connection; the
re-sent copy gets its reply (so the client's retry budget is never what fails the test)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.helpers import free_port


class LossyProxy:
    """Listens on 127.0.0.1:`port`, forwards to `upstream_port`; counts `matched` and `lost` replies."""

    def __init__(self, upstream_port: int, *, marker: bytes = b"EVALSHA", every: int = 2,
                 max_lost: int = 1_000_000, delay_s: float | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.marker = marker
        self.every = every
        self.max_lost = max_lost
        self.delay_s = delay_s
        self.matched = 0
        self.lost = 0
        self._seen: set[bytes] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def __aenter__(self) -> LossyProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        self._writers.update((client_w, up_w))
        lose_next: list[bool] = []  # one flag per command in flight on this connection
        tasks = {asyncio.create_task(self._requests(client_r, up_w, lose_next)),
                 asyncio.create_task(self._replies(up_r, client_w, lose_next))}
        self._tasks.update(tasks)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, up_w):
            writer.close()
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        self._tasks.difference_update(tasks)

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lose: list[bool]) -> None:
        while data := await reader.read(65536):
            if self.marker in data:
                first = data not in self._seen
                self._seen.add(data)
                self.matched += first
                lose.append(first and self.matched % self.every == 0 and self.lost < self.max_lost)
            writer.write(data)
            await writer.drain()

    async def _replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lose: list[bool]) -> None:
        while data := await reader.read(65536):
            if lose and lose.pop(0):
                self.lost += 1
                if self.delay_s is not None:
                    await asyncio.sleep(self.delay_s)  # past the client's timeout: it has given up
                return  # the reply is dropped and the connection cut
            writer.write(data)
            await writer.drain()


CUT = b"<cut>"  # a fault: close the client's connection instead of answering (redis-py: ConnectionError)
STALL = b"<stall>"  # a fault: never answer; the connection is closed after `stall_s` (redis-py: TimeoutError)


class FaultProxy:
    """A TCP proxy in front of a real Redis, run in a thread of its own (so a gateway process can
    use it across tests), that answers chosen commands with faults instead of forwarding them.

    `inject(b"XREAD", [b"-MOVED 1 127.0.0.1:1\\r\\n", CUT, ...])`: each of the next commands named
    XREAD that arrives alone in its packet (what redis-py sends outside pipelines) gets the next
    fault: raw bytes written as the reply (an error line, a reply of the wrong shape, garbage),
    CUT or STALL. `delay_replies(b"TIME", 1.5)`: every TIME is forwarded but its reply held that
    long. `served[name]` counts the commands forwarded, `pending(name)` the faults not yet used.
    """

    def __init__(self, upstream_port: int, *, stall_s: float = 8.0) -> None:
        import threading

        self.upstream_port = upstream_port
        self.port = free_port()
        self.stall_s = stall_s
        self.served: dict[bytes, int] = {}
        self._faults: dict[bytes, list[bytes]] = {}
        self._delays: dict[bytes, float] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def inject(self, command: bytes, faults: list[bytes]) -> None:
        """Queue `faults` for `command`; returns once the proxy's thread holds them, so that every
        such command sent after this call meets them first (not one already on its way)."""
        held = threading.Event()

        def add() -> None:
            self._faults.setdefault(command.upper(), []).extend(faults)
            held.set()

        self._loop.call_soon_threadsafe(add)
        if not held.wait(5):
            raise RuntimeError("the proxy's thread did not take the faults within 5 s")

    def delay_replies(self, command: bytes, delay_s: float) -> None:
        self._loop.call_soon_threadsafe(self._delays.__setitem__, command.upper(), delay_s)

    def pending(self, command: bytes) -> int:
        return len(self._faults.get(command.upper(), ()))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()  # stop() was called: close every connection, then the loop itself
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        delay: list[float] = []  # the hold for the reply of the command in flight (one at a time outside pipelines)
        tasks = {asyncio.ensure_future(self._requests(client_r, client_w, up_w, delay)),
                 asyncio.ensure_future(self._replies(up_r, client_w, delay))}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (client_w, up_w):
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    def _command(self, data: bytes) -> bytes | None:
        """The name of the one command `data` holds, else None (a pipeline, or part of a command)."""
        import hiredis

        reader = hiredis.Reader()
        try:
            reader.feed(data)
            first = reader.gets()
            if not isinstance(first, list) or not first or reader.gets() is not False:
                return None
        except hiredis.ProtocolError:
            return None
        return bytes(first[0]).upper()

    async def _requests(self, reader: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                        up_w: asyncio.StreamWriter, delay: list[float]) -> None:
        while data := await reader.read(65536):
            name = self._command(data)
            faults = self._faults.get(name or b"")
            if faults:
                fault = faults.pop(0)
                if fault == CUT:
                    return
                if fault == STALL:
                    await asyncio.sleep(self.stall_s)
                    return
                client_w.write(fault)
                continue
            if name is not None:
                self.served[name] = self.served.get(name, 0) + 1
                if name in self._delays:
                    delay.append(self._delays[name])
            up_w.write(data)
            await up_w.drain()

    async def _replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: list[float]) -> None:
        while data := await reader.read(65536):
            if delay:
                await asyncio.sleep(delay.pop(0))
            writer.write(data)
            await writer.drain()
