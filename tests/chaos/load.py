"""Closed-loop HTTP load for the chaos scenarios, and the figures each one prints and asserts.

Every request sends a unique integer to the `synthetic` model (which echoes it), so an answer
that is not the request's own shows up as foreign; a request that gets no HTTP answer within
its deadline plus `slack_s` counts as lost. With fault injection on, the workers record every
execution by request id (worker/batch/execlog.py); `check_executions` turns that into the
delivery verdict: run at least once, and more than once only when a process died mid-batch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import REQUESTS_FIELD, split_requests
from vramguard.worker.batch.execlog import read_executions

POOL_CONNECTIONS = 5
# Below uvicorn's timeout_keep_alive (5 s): a client must drop an idle connection before the
# server does, or a request sent on it as the server closes it fails without reaching the app.
KEEPALIVE_EXPIRY_S = 2.0
FIGURES = Path(__file__).resolve().parents[2] / "test-artifacts" / "chaos-figures.txt"


@dataclass(frozen=True, slots=True)
class Result:
    """One request: when it was sent and answered (monotonic s), and how."""

    value: int
    sent_s: float
    answered_s: float
    status: int | None  # None: no HTTP answer (lost)
    code: str | None = None  # error code from the body
    request_id: str | None = None
    own_output: bool = False  # a 200 whose outputs are exactly [value]
    retry_after: str | None = None
    message: str | None = None

    @property
    def latency_s(self) -> float:
        return self.answered_s - self.sent_s


@dataclass
class Tally:
    """The figures of one scenario."""

    results: list[Result] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return len(self.results)

    @property
    def ok(self) -> int:
        return sum(1 for r in self.results if r.status == 200)

    @property
    def errors(self) -> Counter[str]:
        return Counter(f"{r.status} {r.code}" for r in self.results if r.status not in (200, None))

    @property
    def lost(self) -> int:
        return sum(1 for r in self.results if r.status is None)

    @property
    def foreign(self) -> int:
        """200 answers whose outputs are not the request's own input (another request's reply)."""
        return sum(1 for r in self.results if r.status == 200 and not r.own_output)

    def report(self, scenario: str, wall_s: float, **extra: object) -> str:
        """Print the figures (and append them to test-artifacts/chaos-figures.txt); returns the line."""
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        more = "".join(f" {k}={v}" for k, v in extra.items())
        return record_figures(f"[chaos] {scenario}: sent={self.sent} 200={self.ok} errors={{{errors}}} "
                              f"lost={self.lost} foreign={self.foreign} wall_s={wall_s:.1f}{more}")

    def assert_each_answered_with_its_own(self) -> None:
        """Each request got an HTTP answer (none lost) carrying its own output (none crossed with
        another's). How often each ran is `check_executions`' question, not this one's."""
        assert self.lost == 0, [r for r in self.results if r.status is None][:5]
        assert self.foreign == 0


class Load:
    """Sends requests to `url`'s synthetic model from up to `clients` concurrent connections."""

    def __init__(self, url: str, clients: int, *, timeout_ms: int | None = None, slack_s: float = 5.0) -> None:
        self.url = url
        self.clients = clients
        self.timeout_ms = timeout_ms
        self.tally = Tally()
        self._values = itertools.count()
        # Client-side timeout: the deadline plus slack; past it the request counts as lost (hung).
        self._client_timeout_s = (timeout_ms or 30_000) / 1000 + slack_s
        # One small pool per POOL_CONNECTIONS clients: httpx's pool costs CPU per request that
        # grows with its size, and this process shares 2 cores with the stack under test.
        self._pools = [
            httpx.AsyncClient(base_url=url, timeout=self._client_timeout_s,
                              limits=httpx.Limits(max_connections=2 * POOL_CONNECTIONS,  # room for uneven use
                                                  max_keepalive_connections=2 * POOL_CONNECTIONS,
                                                  keepalive_expiry=KEEPALIVE_EXPIRY_S))
            for _ in range(-(-clients // POOL_CONNECTIONS))
        ]
        self._next_pool = itertools.cycle(self._pools)

    async def __aenter__(self) -> Load:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def request(self, payload: object | None = None, timeout_ms: int | None = None) -> Result:
        """One POST; `payload` replaces the echoed integer (e.g. a fault input)."""
        value = next(self._values)
        sent = value if payload is None else payload
        body: dict[str, object] = {"inputs": [sent]}
        if (timeout_ms or self.timeout_ms) is not None:
            body["timeout_ms"] = timeout_ms or self.timeout_ms
        sent_s = time.monotonic()
        try:
            response = await next(self._next_pool).post("/v1/models/synthetic/infer", json=body)
        except httpx.HTTPError as exc:
            result = Result(value, sent_s, time.monotonic(), None, message=repr(exc))
        else:
            result = _result(value, sent, sent_s, response)
        self.tally.results.append(result)
        return result

    async def run_for(self, duration_s: float, *, pause_s: Callable[[Result], float] = lambda r: 0.0) -> Tally:
        """`clients` closed loops for `duration_s`; each waits `pause_s(result)` between requests."""
        until = time.monotonic() + duration_s

        async def loop() -> None:
            while time.monotonic() < until:
                result = await self.request()
                await asyncio.sleep(pause_s(result))

        await asyncio.gather(*(loop() for _ in range(self.clients)))
        return self.tally

    async def run_count(self, total: int) -> Tally:
        """`total` requests over `clients` closed loops."""
        left = itertools.count()

        async def loop() -> None:
            while next(left) < total:
                await self.request()

        await asyncio.gather(*(loop() for _ in range(self.clients)))
        return self.tally


@dataclass
class Answer:
    """One request of `open_loop`: sent at `sent_s` (from its start), answered `latency_s` later."""

    sent_s: float
    latency_s: float
    status: int | None
    code: str | None


async def open_loop(url: str, rate_per_s: float, duration_s: float, started: float, timeout_ms: int) -> list[Answer]:
    """`rate_per_s` requests a second to the synthetic model for `duration_s` from `started`
    (monotonic s), each sent on schedule whatever the others do (an open loop: a slow answer does not
    slow the sending, as a closed loop's clients stuck on a fault would), each with `timeout_ms`."""
    answers: list[Answer] = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_ms / 1000 + 10,
                                 limits=httpx.Limits(max_connections=1000)) as http:

        async def one(value: int) -> None:
            sent = time.monotonic()
            try:
                response = await http.post("/v1/models/synthetic/infer",
                                           json={"inputs": [value], "timeout_ms": timeout_ms})
                code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
                status: int | None = response.status_code
            except httpx.HTTPError as exc:
                status, code = None, repr(exc)
            answers.append(Answer(sent - started, time.monotonic() - sent, status, code))

        tasks = []
        for value in range(int(rate_per_s * duration_s)):
            await asyncio.sleep(max(0.0, started + value / rate_per_s - time.monotonic()))
            tasks.append(asyncio.create_task(one(value)))
        await asyncio.gather(*tasks)
    return answers


def _result(value: int, sent: object, sent_s: float, response: httpx.Response) -> Result:
    answered_s = time.monotonic()
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code == 200:
        return Result(value, sent_s, answered_s, 200, request_id=body.get("request_id"),
                      own_output=body.get("outputs") == [sent])
    error = body.get("error", {}) if isinstance(body, dict) else {}
    return Result(value, sent_s, answered_s, response.status_code, code=error.get("code"),
                  request_id=error.get("request_id"), retry_after=response.headers.get("retry-after"),
                  message=error.get("message"))


def record_figures(line: str) -> str:
    """Print a scenario's figures and append them to test-artifacts/chaos-figures.txt."""
    print(line)
    FIGURES.parent.mkdir(exist_ok=True)
    with FIGURES.open("a") as out:
        out.write(line + "\n")
    return line


def count_logged(log_dir: Path, message: str) -> int:
    """How many log lines of the stack's processes carry `message` (e.g. "entry reclaimed")."""
    needle = f'"message": "{message}"'
    return sum(path.read_text(errors="replace").count(needle) for path in log_dir.glob("*.log"))


def count_reclaimed_requests(log_dir: Path) -> int:
    """Requests in the entries the workers reclaimed: the `requests` of each "entry reclaimed" line
    (a pack of several requests is one entry, split and run again whole)."""
    needle = '"message": "entry reclaimed"'
    return sum(int(json.loads(line).get("requests", 1)) for path in log_dir.glob("*.log")
               for line in path.read_text(errors="replace").splitlines() if needle in line)


async def held_requests(redis: aioredis.Redis, stream: str, consumer: str) -> int:
    """Requests in the entries pending for `consumer`: a pack (worker/batch/entries.py) counts each."""
    held = await redis.xpending_range(stream, GROUP, "-", "+", 1000, consumername=consumer)
    total = 0
    for pending in held:
        for _id, fields in await redis.xrange(stream, pending["message_id"], pending["message_id"]):
            total += len(split_requests(fields[REQUESTS_FIELD])) if REQUESTS_FIELD in fields else 1
    return total


async def check_executions(redis: aioredis.Redis, key_prefix: str, tally: Tally, died: set[int]) -> int:
    """Assert the delivery verdict from the workers' execution log (fault injection on): every
    request answered 200 ran at least once, and a request ran more than once only when all its
    runs but one were in a process that died (pids in `died`). Returns how many ran more than once."""
    runs = read_executions(await redis.hkeys(Keys(key_prefix).executions("synthetic")))
    answered = [r.request_id for r in tally.results if r.status == 200]
    assert answered, "no request succeeded"
    never_ran = [rid for rid in answered if rid not in runs]
    assert not never_ran, f"{len(never_ran)} answered 200 without an execution: {never_ran[:3]}"
    repeated = {rid: pids for rid, pids in runs.items() if len(pids) > 1}
    unexplained = {rid: pids for rid, pids in repeated.items() if sum(p not in died for p in pids) > 1}
    assert not unexplained, f"ran more than once with no death to explain it: {list(unexplained.items())[:3]}"
    return len(repeated)


async def slowest_immediate_answer_s(load: Load, n: int) -> float:
    """The slowest of `n` concurrent requests the gateway refuses at once (422, an empty input
    list): the client's and gateway's own queueing of n connections on this machine, now."""
    async with httpx.AsyncClient(base_url=load.url, timeout=30) as client:

        async def one() -> float:
            started = time.monotonic()
            await client.post("/v1/models/synthetic/infer", json={"inputs": []})
            return time.monotonic() - started

        return max(await asyncio.gather(*(one() for _ in range(n))))
