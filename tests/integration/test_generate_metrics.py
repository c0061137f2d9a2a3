"""A streamed generation is counted on /metrics under how its stream ended, and timed to that end:
through a gateway process and a synthetic-LM worker process (worker/generate/synthetic_lm.py,
50 ms a step), the real HTTP client reading the SSE events."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import Stack, synthetic_lm_models, wait_until
from tests.integration.test_metrics import matching, scrape, value

MODEL = "simlm"
STEP_MS = 50.0
DEADLINE_MS = 1500  # the second stream's: 200 tokens take 10 s at 50 ms a step


async def _events(http: httpx.AsyncClient, max_tokens: int, *, headers: dict[str, str] | None = None,
                  leave_after: int | None = None) -> list[str]:
    """The `data:` lines of one streamed completion; `leave_after`: close the connection after
    that many, as a client that stops reading does."""
    body = {"model": MODEL, "prompt": "a bb ccc", "max_tokens": max_tokens, "stream": True, "temperature": 0}
    lines: list[str] = []
    async with http.stream("POST", "/v1/completions", json=body, headers=headers or {}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if leave_after is not None and len(lines) >= leave_after:
                    break
    return lines


async def _serve_simlm(stack: Stack, tmp_path: Path) -> None:
    """A gateway and one synthetic-LM worker (STEP_MS a step, a 512-token window), ready."""
    models = synthetic_lm_models(tmp_path, window=512, params={"step_ms": STEP_MS})
    common = {"models_file": str(models), "served_models": MODEL}
    stack.start_gateway(**common)
    stack.start_worker(model=MODEL, **common)
    await stack.wait_ready()


@pytest.mark.slow  # two processes' start and three streams: about 20 s on 2 busy cores
@pytest.mark.timeout(180)
async def test_streamed_generations_are_counted_under_how_their_stream_ended(stack: Stack, tmp_path: Path) -> None:
    """1. A stream of 3 tokens, read to its end.
    2. A stream of 200 tokens with a 1.5 s deadline: it ends with an error event, deadline_exceeded.
    3. A stream of 200 tokens that the client leaves after 3 events.
    Result: /metrics counts one request each under outcome ok, deadline_exceeded and cancelled (they
    used to be counted ok when their first event was sent), the deadline's one timed past its
    deadline, and no request of the model is left in flight."""
    await _serve_simlm(stack, tmp_path)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        whole = await _events(http, 3)
        assert whole[-1] == "data: [DONE]"
        late = await _events(http, 200, headers={"X-Request-Timeout-Ms": str(DEADLINE_MS)})
        assert '"code":"deadline_exceeded"' in late[-1], late[-1]
        await _events(http, 200, leave_after=3)

        async def counted() -> bool:
            samples, _ = await scrape(http)
            return value(samples, "vramguard_requests_total", model=MODEL, outcome="cancelled") == 1

        await wait_until(counted, 20)
        samples, _ = await scrape(http)
    for outcome in ("ok", "deadline_exceeded", "cancelled"):
        assert value(samples, "vramguard_requests_total", model=MODEL, outcome=outcome) == 1, outcome
    took = value(samples, "vramguard_request_duration_seconds_sum", model=MODEL, outcome="deadline_exceeded")
    assert took is not None and took >= DEADLINE_MS / 1000, took
    assert value(samples, "vramguard_requests_in_flight", model=MODEL) == 0


@pytest.mark.slow  # two processes' start and a 10 s generation cut short: about 15 s on 2 busy cores
@pytest.mark.timeout(180)
async def test_a_client_gone_before_the_stream_starts_is_counted_and_its_generation_cancelled(
        stack: Stack, tmp_path: Path) -> None:
    """1. A client sends a streamed completion of 200 tokens (10 s at 50 ms a step) over a raw socket
       and closes it at once, before any response (the first token comes in ~50 ms, mostly before
       the gateway watches the connection: then it learns of the leaving as the response starts).
    2. A second request, read to its end, shows the gateway still serves.
    Result: within 5 s the first request is counted as the client's leaving (cancelled when its
    response had started, client_disconnected when the wait for the first token saw it), none of
    the model's is left in flight and the worker reports the sequence cancelled, well before its
    200 tokens' 10 s."""
    await _serve_simlm(stack, tmp_path)
    body = json.dumps({"model": MODEL, "prompt": "a bb ccc", "max_tokens": 200, "stream": True}).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    writer.close()
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        assert (await _events(http, 3))[-1] == "data: [DONE]"

        async def settled() -> bool:
            samples, _ = await scrape(http)
            workers = (await http.get(f"/v1/models/{MODEL}")).json()["workers"]
            gone = sum(value(samples, "vramguard_requests_total", model=MODEL, outcome=outcome) or 0
                       for outcome in ("cancelled", "client_disconnected"))
            return (gone == 1 and value(samples, "vramguard_requests_in_flight", model=MODEL) == 0
                    and next(iter(workers.values()))["generation"]["cancelled"] == 1)

        await wait_until(settled, 5)


@pytest.mark.slow  # two processes' start: about 10 s on 2 busy cores
@pytest.mark.timeout(180)
async def test_time_to_first_token_counts_from_the_workers_admission(stack: Stack, tmp_path: Path) -> None:
    """One completion of 3 tokens (50 ms a step), timed by the client.
    Result: /metrics' time to first token has one observation, no longer than the client's whole
    request (it was the time since the machine booted: a sequence's admission time was never set)."""
    await _serve_simlm(stack, tmp_path)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        started = time.monotonic()
        assert (await _events(http, 3))[-1] == "data: [DONE]"
        took_s = time.monotonic() - started

        async def observed() -> bool:
            samples, _ = await scrape(http)
            return sum(matching(samples, "vramguard_time_to_first_token_seconds_count").values()) == 1

        await wait_until(observed, 20)
        samples, _ = await scrape(http)
    ttft_s = sum(matching(samples, "vramguard_time_to_first_token_seconds_sum").values())
    assert 0 < ttft_s <= took_s, (ttft_s, took_s)
