"""Scenarios of generated streams under faults, with the synthetic LM (worker/generate/synthetic_lm.py:
token t + 1 after token t, 30 ms a step, chunks every 60 ms so that chunks hold a few tokens each)
in real worker processes, a real gateway process and a real Redis. A test holds one decode step
of whichever worker runs it (worker/generate/stephold.py) to fault it at a known point.

1. Duplicate generation: the worker generating is held mid-step and SIGSTOPped past
   claim_idle_ms; the other worker reclaims the entry and resumes the stream from its progress;
   then the first is SIGCONTed and finishes its step.
2. A failed publish: the worker generating is held mid-step, Redis is shut down (its data saved),
   the step ends and its progress and chunk cannot be written; Redis is back about 5 s later.
3. A step that never returns: the worker generating is held for good; forward_timeout_s is 3 s.
4. A device that breaks: from its next step on, every step and probe of the worker generating
   raises CUDA's illegal-memory-access error (a sticky error: every launch fails after it).

Result: each client's streamed text is exactly the greedy text (each character once, none
missing); in 1 the stalled worker learns at its next progress write that its entry is gone, stops
the sequence and stays up, and the sequence finishes once; in 2 the worker's round failed and it
stayed up; in 3 the held worker exits FORWARD_HUNG and the other finishes the stream; in 4 the
broken worker's probe after the failed step fails too, it exits UNHEALTHY without answering the
sequence, and the other resumes it (no error reaches the client).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.helpers import RedisServer, Stack, wait_until
from vramguard.worker.generate.stephold import hold_path
from vramguard.worker.runner import ExitCode

pytestmark = pytest.mark.timeout(240)
MODEL = "simlm"
PROMPT = "a bb ccc"  # the synthetic LM's tokens: 1 + each word's length (2, 3, 4), so it goes on from 5
TOKENS = 100


def _models_file(folder: Path, **defaults: object) -> Path:
    params = "params = { step_ms = 30.0, chunk_ms = 60.0, hold_step = 1.0 }"
    extra = "".join(f", {k} = {json.dumps(v)}" for k, v in defaults.items())
    path = folder / "models.toml"
    path.write_text(f"""
[{MODEL}]
backend = "vramguard.worker.generate.synthetic_lm:SyntheticLMBackend"
description = "synthetic generative model (tests)"
input_kind = "json"
output = {{ kind = "json", keys = ["next_token"] }}
options = {{ generates = true, context_window = 512 }}
defaults = {{ max_batch_size = 8, max_wait_ms = 1.0, default_timeout_ms = 180000, {params}{extra} }}
""")
    return path


def _greedy(tokens: int) -> str:
    return "".join(f" w{5 + k}" for k in range(tokens))


class Faults:
    """The stack of one scenario: gateway, `workers` synthetic workers, and the step hold."""

    def __init__(self, stack: Stack, workers: int, **defaults: object) -> None:
        self.stack = stack
        self.common = {"models_file": str(_models_file(stack.log_dir, **defaults)), "served_models": MODEL,
                       "claim_idle_ms": 1000, "reclaim_interval_ms": 200}
        stack.start_gateway(**self.common)
        self.workers = [stack.start_worker(model=MODEL, **self.common) for _ in range(workers)]
        self.hold = hold_path(str(stack.settings["key_prefix"]), MODEL)

    async def ready(self) -> None:
        """Every worker ready (its KV plan measured): a step hold or a device break set while one
        still measures would be taken by its probe steps instead of by a served sequence's step."""
        await self.stack.wait_ready()

        def all_ready() -> bool:
            workers = httpx.get(f"{self.stack.url}/v1/models/{MODEL}").json()["workers"].values()
            return len(workers) == len(self.workers) and all(w["state"] == "ready" for w in workers)

        await wait_until(all_ready, 90, interval_s=0.2)

    async def held_pid(self) -> int:
        """Hold the next step of whichever worker steps first; its pid once it is held there."""
        Path(self.hold).write_text("")
        held = Path(self.hold + ".held")
        await wait_until(lambda: held.exists() and held.read_text().strip() != "", 60)
        return int(held.read_text())

    def release(self) -> None:
        Path(self.hold + ".held").unlink(missing_ok=True)

    def log_of(self, pid: int) -> str:
        index = next(i for i, p in enumerate(self.workers) if p.pid == pid)
        return (self.stack.log_dir / f"worker-{index}.log").read_text(errors="replace")

    def proc(self, pid: int) -> subprocess.Popen[bytes]:
        return next(p for p in self.workers if p.pid == pid)

    def cleanup(self) -> None:
        for path in (self.hold, self.hold + ".held"):
            Path(path).unlink(missing_ok=True)


class Stream:
    """One streamed greedy completion read by a real HTTP client; `text` grows as chunks arrive."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.text = ""
        self.request_id = ""
        self.events: list[dict[str, object]] = []

    async def run(self) -> str:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
        async with httpx.AsyncClient(base_url=self.url, timeout=180) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                self.request_id = response.headers["x-request-id"]
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        self.events.append(event)
                        self.text += event["choices"][0]["text"]
        return self.text


async def _streaming(stack: Stack, fault: Callable[[Stream], Awaitable[None]]) -> Stream:
    """A stream, faulted by `fault` once 20 characters of it have arrived; returns it finished."""
    stream = Stream(stack.url)
    task = asyncio.create_task(stream.run())
    await wait_until(lambda: len(stream.text) >= 20 or task.done(), 60)
    await fault(stream)
    await asyncio.wait_for(task, 180)
    return stream


@pytest.fixture
async def faults() -> AsyncIterator[Callable[..., Faults]]:
    made: list[Faults] = []

    def make(stack: Stack, workers: int, **defaults: object) -> Faults:
        made.append(Faults(stack, workers, **defaults))
        return made[-1]

    yield make
    for f in made:
        for proc in f.workers:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process would not take the SIGTERM
        f.cleanup()


async def test_a_stalled_worker_whose_entry_was_reclaimed_stops_and_the_text_is_whole(
        stack: Stack, faults: Callable[..., Faults]) -> None:
    # The stalled worker's step is timed by the hang guard: a limit far past the stall.
    f = faults(stack, 2, forward_timeout_s=120.0)
    await f.ready()
    stalled: list[int] = []

    async def stall(stream: Stream) -> None:
        pid = await f.held_pid()
        stalled.append(pid)
        os.kill(pid, signal.SIGSTOP)
        f.release()  # the step ends when the process runs again
        other = next(p.pid for p in f.workers if p.pid != pid)
        await wait_until(lambda: "sequence resumed" in f.log_of(other), 60, interval_s=0.2)
        grown = len(stream.text)
        await wait_until(lambda: len(stream.text) > grown, 60)  # the successor streams now
        os.kill(pid, signal.SIGCONT)
        await wait_until(lambda: "sequence lost to another worker" in f.log_of(pid), 60, interval_s=0.2)

    stream = await _streaming(stack, stall)
    assert stream.text == _greedy(TOKENS)
    assert stream.events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]

    def finished() -> dict[int, list[str]]:  # logged just after the last chunk went out
        return {p.pid: [line for line in f.log_of(p.pid).splitlines()
                        if "sequence finished" in line and stream.request_id in line] for p in f.workers}

    await wait_until(lambda: sum(map(len, finished().values())) > 0, 30, interval_s=0.2)
    assert finished()[stalled[0]] == [] and sum(map(len, finished().values())) == 1, finished()  # the successor's
    assert all(p.poll() is None for p in f.workers)  # the stalled worker stopped the sequence, not itself

    def counted() -> bool:  # /metrics reads the heartbeats the gateway last fetched: allow it a refresh
        text = httpx.get(stack.url + "/metrics").text
        return re.search(r"^vramguard_generation_lost_total\{[^}]*\} 1\.0$", text, re.M) is not None

    await wait_until(counted, 30, interval_s=0.5)


async def test_a_step_that_never_returns_ends_its_worker_and_another_finishes_the_stream(
        stack: Stack, faults: Callable[..., Faults]) -> None:
    f = faults(stack, 2, forward_timeout_s=3.0)
    await f.ready()
    held: list[int] = []

    async def hang(stream: Stream) -> None:
        held.append(await f.held_pid())  # never released
        await wait_until(lambda: f.proc(held[0]).poll() is not None, 60, interval_s=0.2)

    stream = await _streaming(stack, hang)
    assert stream.text == _greedy(TOKENS)
    assert f.proc(held[0]).returncode == ExitCode.FORWARD_HUNG
    assert "hung; exiting for a restart" in f.log_of(held[0])
    other = next(p.pid for p in f.workers if p.pid != held[0])
    assert "sequence resumed" in f.log_of(other) and f.proc(other).poll() is None


async def test_a_broken_device_ends_its_worker_and_another_finishes_the_stream(
        stack: Stack, faults: Callable[..., Faults]) -> None:
    f = faults(stack, 2)
    await f.ready()
    broken: list[int] = []

    async def breaks(stream: Stream) -> None:
        Path(f.hold + ".break").write_text("")
        taken = Path(f.hold + ".break.taken")
        await wait_until(lambda: taken.exists() and taken.read_text().strip() != "", 60)
        broken.append(int(taken.read_text()))
        await wait_until(lambda: f.proc(broken[0]).poll() is not None, 60, interval_s=0.2)

    try:
        stream = await _streaming(stack, breaks)
    finally:
        for path in (f.hold + ".break", f.hold + ".break.taken"):
            Path(path).unlink(missing_ok=True)
    assert stream.text == _greedy(TOKENS)
    assert f.proc(broken[0]).returncode == ExitCode.UNHEALTHY
    log = f.log_of(broken[0])
    assert "generation step failed" in log and "probe failed" in log and "worker unhealthy" in log
    other = next(p.pid for p in f.workers if p.pid != broken[0])
    assert "sequence resumed" in f.log_of(other) and f.proc(other).poll() is None


@pytest.fixture
def own_redis(fast_settings: dict[str, object], tmp_path: Path) -> Iterator[tuple[Stack, RedisServer]]:
    server = RedisServer()
    server.start()
    values = {k: v for k, v in fast_settings.items() if k != "redis_url"}
    stack = Stack(server.url, tmp_path, **values)
    yield stack, server
    stack.stop()
    server.stop()


async def test_a_chunk_whose_publish_failed_is_sent_again_after_redis_is_back(
        own_redis: tuple[Stack, RedisServer], faults: Callable[..., Faults]) -> None:
    stack, server = own_redis
    f = faults(stack, 1)
    await f.ready()

    async def outage(stream: Stream) -> None:
        await f.held_pid()
        client = redis.Redis(port=server.port)
        client.shutdown(save=True)  # an RDB of everything, loaded again at the restart below
        assert server.proc is not None
        server.proc.wait(timeout=30)
        stopped = time.monotonic()
        f.release()  # the step ends now and its publish fails: Redis is gone
        await asyncio.sleep(5.0 - (time.monotonic() - stopped))  # the outage lasts about 5 s
        await asyncio.to_thread(server.start)

    stream = await _streaming(stack, outage)
    assert stream.text == _greedy(TOKENS)
    log = f.log_of(f.workers[0].pid)
    assert "generation round failed" in log and f.workers[0].poll() is None
