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
from vramguard.worker.generate.stephold import hold_path

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


async def _serve_simlm(stack: Stack, tmp_path: Path, **params: float) -> None:
    """A gateway and one synthetic-LM worker (STEP_MS a step, a 512-token window, `params` over
    those), ready."""
    models = synthetic_lm_models(tmp_path, window=512, params={"step_ms": STEP_MS, **params})
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


async def _complete(http: httpx.AsyncClient, max_tokens: int, prompt: str = "a bb ccc",
                    headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return await http.post("/v1/completions", json=body, headers=headers or {})


def _worker_series(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[str, float]:
    """The simlm worker's vramguard_worker_* samples, by name (one worker: its labels dropped)."""
    return {name: v for (name, labels), v in samples.items()
            if name.startswith("vramguard_worker_") and ("model", MODEL) in labels}


@pytest.mark.slow  # two processes' start and about 40 steps of 50 ms: about 15 s on 2 busy cores
@pytest.mark.timeout(180)
async def test_a_generative_workers_request_and_batch_counters_follow_its_sequences(
        stack: Stack, key_prefix: str, tmp_path: Path) -> None:
    """1. Completions of 3, 5 and (streamed) 4 tokens at once, and one whose prompt is only blanks,
       which the worker refuses (400).
    2. A stream of 200 tokens runs; the test holds the worker's next step (stephold.py) and sends
       a completion with a 300 ms deadline, which waits in the stream and gets 504; the stream's
       client leaves; the step is released.
    Result: after 1, the worker's classic series count the generation: 3 requests, 12 items (the
    tokens generated), 1 error, as many forwards as batches (steps), between 5 (the longest
    completion's tokens) and 12 of them, its last success recent. After 2: the late completion
    counted expired (and an error), the stream cancelled, the requests still 3, the items the
    worker's tokens generated, and the batch size, forward duration and queue delay histograms
    holding each step and each sequence that ran (all of them stayed 0: only the generation
    series moved)."""
    await _serve_simlm(stack, tmp_path, hold_step=1)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        sent_s = time.time()
        replies = await asyncio.gather(_complete(http, 3), _complete(http, 5), _events(http, 4),
                                       _complete(http, 2, prompt="   "))
        assert [r.status_code for r in (replies[0], replies[1], replies[3])] == [200, 200, 400], replies
        assert [r.json()["usage"]["completion_tokens"] for r in replies[:2]] == [3, 5]
        assert replies[2][-1] == "data: [DONE]"

        async def served(requests: float, **more: float) -> bool:
            worker = _worker_series((await scrape(http))[0])
            return worker.get("vramguard_worker_requests_total") == requests and all(
                worker.get(f"vramguard_worker_{name}_total") == n for name, n in more.items())

        await wait_until(lambda: served(3, errors=1), 20)
        worker = _worker_series((await scrape(http))[0])
        assert worker["vramguard_worker_items_total"] == 12
        batches = worker["vramguard_worker_batches_total"]
        assert 5 <= batches <= 12 and worker["vramguard_worker_forwards_total"] == batches, worker
        assert 1 <= worker["vramguard_worker_last_batch_size"] <= 3
        assert worker["vramguard_worker_last_ok_time_seconds"] >= sent_s - 1

        hold = Path(hold_path(key_prefix, MODEL))
        async with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 200,
                                                                "stream": True}) as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            hold.touch()
            await wait_until(lambda: Path(f"{hold}.held").exists(), 20)
            late = await _complete(http, 3, headers={"X-Request-Timeout-Ms": "300"})
            assert late.status_code == 504, late.text
        Path(f"{hold}.held").unlink()
        await wait_until(lambda: served(3, errors=2, expired=1, cancelled=1), 20)
        workers = (await http.get(f"/v1/models/{MODEL}")).json()["workers"]
        tokens = next(iter(workers.values()))["generation"]["tokens_generated"]
        samples, _ = await scrape(http)
    worker = _worker_series(samples)
    assert worker["vramguard_worker_items_total"] == tokens > 12

    def histogram(name: str) -> tuple[float, float]:
        """(count, sum) of the worker's histogram `name`."""
        return (sum(matching(samples, f"vramguard_{name}_count", model=MODEL).values()),
                sum(matching(samples, f"vramguard_{name}_sum", model=MODEL).values()))

    assert histogram("batch_size") == (worker["vramguard_worker_batches_total"], tokens)
    assert histogram("forward_duration_seconds")[0] == worker["vramguard_worker_batches_total"]
    assert histogram("queue_delay_seconds")[0] == 4  # the sequences that ran: the three and the stream


@pytest.mark.slow  # two processes' start: about 8 s
@pytest.mark.timeout(180)
async def test_a_step_failing_on_its_input_answers_500_and_the_worker_serves_on(stack: Stack, tmp_path: Path) -> None:
    """A synthetic LM whose steps fail on one token (fail_token: a 20-letter word): a prompt holding
    it, then a plain one. Result: the first gets 500 model_error naming the failure (the probe after
    the failed step passed: the device is sound, the input was at fault); the second gets 200 from
    the same worker, still running and healthy."""
    await _serve_simlm(stack, tmp_path, fail_token=21.0)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        failed = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a " + "x" * 20, "max_tokens": 3})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_error", failed.text
        assert "fails on token 21" in failed.json()["error"]["message"], failed.text
        served = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a bb", "max_tokens": 3})
        assert served.status_code == 200, served.text

        async def probed() -> bool:  # the heartbeat the gateway reads after the probe
            worker = next(iter((await http.get(f"/v1/models/{MODEL}")).json()["workers"].values()))
            return worker["probes"] >= 1 and worker["healthy"] is True  # type: ignore[no-any-return]

        await wait_until(probed, 20)
    assert stack.workers[0].poll() is None
