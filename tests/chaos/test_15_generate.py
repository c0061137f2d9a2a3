"""Scenarios of text generation with the real SmolLM2-135M-Instruct on the CPU: one shared stack
(Redis, a gateway process, one smollm2 worker under the shipped supervisord) for the module.

1. The `openai` client, sync and async, streamed and not: chat and completions; streamed text
   equals the whole reply's for greedy decoding; usage is reported.
2. Bad bodies get a 4xx before anything is queued.
3. Interleaving: 8 streams of 64 tokens, and 1 s later a 1-token request: answered before the 8 end.
4. A client that leaves after 3 tokens: its sequence stops within a few steps, the KV cache
   returns to its idle size, the heartbeat counts it cancelled.
5. SIGKILL of the worker mid-stream (greedy, then seeded sampling): supervisord restarts it, the
   successor resumes from the progress in Redis; the client's text equals an uncrashed run's.
6. The request stream lost, as by a Redis restarted empty: the worker recreates its consumer
   group (its reads failed with NOGROUP for good) and answers again.

Result: every assertion above; each scenario names its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.helpers import ROOT, RedisServer, Stack, SupervisedWorker, service_env, wait_until
from vramguard.shared.keys import Keys

# A worker restart reloads the model (10-60 s on 2 busy cores); the module's stack starts once.
pytestmark = pytest.mark.timeout(400)
PREFIX = "gen"
SETTINGS: dict[str, object] = {
    "served_models": "smollm2", "model": "smollm2", "key_prefix": PREFIX, "block_ms": 200,
    "heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 2000, "probe_interval_s": 0.5, "claim_idle_ms": 1000,
    "reclaim_interval_ms": 200, "torch_threads": 1,
    # The CPU's resident set is a poor measure of a step's peak, and measuring costs a minute on
    # 2 busy cores; the KV plan still comes from the worker's share and the measured bytes per token.
    "memory_planner": "false",
    "models__smollm2__params": json.dumps({"chunk_ms": 0}),  # a chunk per token: scenario 4 counts them
}
STORY = "The old lighthouse keeper climbed the stairs every evening, and"


class GenStack:
    def __init__(self, redis_server: RedisServer, folder: Path) -> None:
        self.redis_url = redis_server.url
        self.stack = Stack(redis_server.url, folder, **SETTINGS)
        self.worker = SupervisedWorker(folder / "sup", service_env(redis_server.url, **SETTINGS))
        (folder / "sup").mkdir()
        self.redis = redis.Redis.from_url(redis_server.url)
        self.keys = Keys(PREFIX)

    @property
    def url(self) -> str:
        return self.stack.url

    def worker_pid(self) -> int:
        log = (self.worker.folder / "supervisord.log").read_text()
        return int(re.findall(rf"spawned: '{re.escape(self.worker.process)}' with pid (\d+)", log)[-1])

    def generation(self) -> dict[str, object]:
        raw = self.redis.hget(self.keys.heartbeat(self.worker.worker_name), "generation")
        return json.loads(raw) if raw else {}

    def last_entry_id(self) -> bytes | None:
        """The id of the last entry ever added to the model's stream (XINFO's last-generated-id: it
        stays put when nothing is added, whatever was acked and deleted since; Redis >= 6.2 has it,
        where entries-added needs 7), or None before the stream exists."""
        key = self.keys.request_stream("smollm2")
        return self.redis.xinfo_stream(key)["last-generated-id"] if self.redis.exists(key) else None


def _ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models/smollm2/ready").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"smollm2 not ready in {timeout_s} s")


@pytest.fixture(scope="module")
def gen(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenStack]:
    s = GenStack(redis_server, tmp_path_factory.mktemp("gen"))
    s.stack.start_gateway()
    s.worker.start()
    try:
        _ready(s.url, 300)
        yield s
    finally:
        s.worker.stop()
        s.stack.stop()
        s.redis.close()


def _client(gen: GenStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=gen.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _streamed_chat(client: openai.OpenAI, **kw: object) -> tuple[str, object]:
    text, usage = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):  # type: ignore[call-overload]
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage


def test_openai_chat_streamed_equals_whole_greedy(gen: GenStack) -> None:
    client = _client(gen)
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
          "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    text, usage = _streamed_chat(client, **kw)
    assert "Paris" in whole.choices[0].message.content
    assert text == whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens > 0
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_the_generate_guides_streaming_snippet_prints_an_answer_and_its_usage(gen: GenStack) -> None:
    """docs/guides/generate.md: its `openai` snippet, pointed at this stack's port, run as written."""
    page = (ROOT / "docs" / "guides" / "generate.md").read_text()
    block = page.split("## Stream from Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    host = gen.url.removeprefix("http://")
    done = subprocess.run([sys.executable, "-c", block.replace("127.0.0.1:8000", host)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answer, usage = done.stdout.rsplit("\n", 1)
    assert "Paris" in answer, done.stdout
    assert usage.startswith("CompletionUsage(completion_tokens="), done.stdout


async def test_openai_async_completions_streamed_and_whole(gen: GenStack) -> None:
    client = openai.AsyncOpenAI(base_url=gen.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    whole = await client.completions.create(model="smollm2", prompt=STORY, max_tokens=12, temperature=0)
    parts = [c.choices[0].text async for c in await client.completions.create(
        model="smollm2", prompt=STORY, max_tokens=12, temperature=0, stream=True)]
    assert "".join(parts) == whole.choices[0].text != ""
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    seeded = [(await client.completions.create(model="smollm2", prompt=STORY, max_tokens=12, temperature=0.9,
                                               seed=11)).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]  # the sampler's randomness comes from the seed, not the process
    await client.close()


BAD_BODIES = [
    ("chat", {"model": "smollm2", "messages": []}),
    ("chat", {"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": 5}]}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}] * 1000}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": [], "logprobs": True}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}),
    ("chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}),
    ("text", {"model": "smollm2", "prompt": "x" * (10 * 1024 * 1024)}),
    ("text", {"model": "smollm2", "prompt": "x" * 300_000}),
]


def test_bad_bodies_refused_before_queueing(gen: GenStack) -> None:
    before = gen.last_entry_id()
    for kind, body in BAD_BODIES:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        response = httpx.post(gen.url + path, json=body, timeout=60)
        assert 400 <= response.status_code < 500, (body.keys(), response.status_code)
        assert response.json()["error"]["message"]
    raw = httpx.post(gen.url + "/v1/completions", content=b'{"model": "smollm2", "prompt": "\xff\xfe"}',
                     headers={"Content-Type": "application/json"})
    assert raw.status_code == 400
    unsupported = httpx.post(gen.url + "/v1/chat/completions", json=BAD_BODIES[6][1]).json()["error"]["message"]
    assert "tools" in unsupported and "logprobs" in unsupported
    # prompt + max_tokens over the window: counted with the tokenizer the worker published, in OpenAI's words
    response = httpx.post(gen.url + "/v1/completions", timeout=60,
                          json={"model": "smollm2", "prompt": "word " * 1500, "max_tokens": 1000})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
    assert error["message"].startswith("This model's maximum context length is 2048 tokens, however you requested 25")
    assert "1000 for the completion" in error["message"] and "(15" in error["message"], error["message"]
    native = httpx.post(gen.url + "/v1/models/smollm2/infer", json={"inputs": ["Once upon a time"]}, timeout=60)
    assert native.status_code == 422 and "/v1/chat/completions" in native.json()["error"]["message"], native.text
    assert gen.last_entry_id() == before


def test_an_over_long_prompt_gets_openais_context_length_exceeded_streamed_or_not(gen: GenStack) -> None:
    """The gateway counts the prompt with the tokenizer the worker published: 1,500 words plus
    max_tokens 1000 pass the 2048-token window, refused before anything is queued or streamed."""
    before = gen.last_entry_id()
    for stream in (False, True):
        with _client(gen) as client, pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 1500}],
                                           max_tokens=1000, stream=stream)
        error = caught.value
        assert error.code == "context_length_exceeded" and error.param == "messages", error.body
        assert isinstance(error.body, dict) and error.body["message"].startswith(
            "This model's maximum context length is 2048 tokens. However, you requested 25"), error.body
        assert error.body["message"].endswith(" in the messages, 1000 in the completion). Please reduce the length "
                                              "of the messages or completion."), error.body
    assert gen.last_entry_id() == before


def test_neutral_openai_values_are_answered_as_the_plain_body(gen: GenStack) -> None:
    """logprobs false, penalties 0, role developer (OpenAI's newer name for system) and content as
    a list of text parts (joined by newlines) ask for nothing this server lacks: greedy decoding
    gives the plain body's text."""
    client = _client(gen)
    kw = {"model": "smollm2", "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(messages=[  # type: ignore[call-overload]
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?\nAnswer:"}], **kw)
    neutral = client.chat.completions.create(messages=[  # type: ignore[call-overload]
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"},
                                     {"type": "text", "text": "Answer:"}]}],
        logprobs=False, presence_penalty=0, frequency_penalty=0, **kw)
    assert neutral.choices[0].message.content == plain.choices[0].message.content != ""
    assert neutral.usage.prompt_tokens == plain.usage.prompt_tokens
    text = client.completions.create(model="smollm2", prompt=STORY, max_tokens=4, temperature=0,
                                     presence_penalty=0, frequency_penalty=0)
    assert text.usage is not None and text.usage.completion_tokens == 4


async def test_a_worker_generating_past_its_probe_window_stays_ready(gen: GenStack) -> None:
    """1. Readiness calls a worker live while its last probe or batch is younger than
       2 x probe_interval_s + heartbeat_ttl_ms (3 s in this stack); a busy worker does not probe.
    2. One stream of 128 greedy tokens runs while /health/ready is polled every 0.25 s.
    Result: the stream outlasts that window and every poll answers 200 (decode steps count)."""
    client = openai.AsyncOpenAI(base_url=gen.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    statuses: list[int] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=gen.url, timeout=30) as http:
            while not done.is_set():
                statuses.append((await http.get("/health/ready")).status_code)
                await asyncio.sleep(0.25)

    async def generate() -> None:
        try:
            stream = await client.completions.create(model="smollm2", prompt=STORY, max_tokens=128, temperature=0,
                                                     stream=True)
            async for _chunk in stream:
                pass
        finally:
            done.set()

    started = time.monotonic()
    await asyncio.gather(poll(), generate())
    await client.close()
    assert time.monotonic() - started > 3.0  # else the window was never at stake
    assert statuses and set(statuses) == {200}, statuses


async def test_short_request_overtakes_eight_long_streams(gen: GenStack) -> None:
    client = openai.AsyncOpenAI(base_url=gen.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    ended: dict[str, float] = {}

    async def long(i: int) -> str:
        stream = await client.completions.create(model="smollm2", prompt=f"{STORY} on day {i}", max_tokens=64,
                                                 temperature=0, stream=True)
        reason = None
        async for chunk in stream:
            reason = chunk.choices[0].finish_reason or reason
        ended[f"long{i}"] = time.monotonic()
        return str(reason)

    async def short() -> None:
        await asyncio.sleep(1.0)
        await client.completions.create(model="smollm2", prompt="Hello", max_tokens=1, temperature=0)
        ended["short"] = time.monotonic()

    reasons = await asyncio.gather(*(long(i) for i in range(8)), short())
    await client.close()
    assert reasons[:8] == ["length"] * 8  # all eight really ran 64 tokens
    assert ended["short"] < min(t for k, t in ended.items() if k != "short")


async def test_client_leaving_after_3_tokens_stops_its_sequence(gen: GenStack) -> None:
    await wait_until(lambda: gen.generation().get("running") == 0, 60)
    before = gen.generation()
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 200, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(base_url=gen.url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            tokens = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    tokens += 1
                if tokens == 3:
                    break
    await wait_until(lambda: gen.generation().get("cancelled", 0) == before["cancelled"] + 1, 60)
    after = gen.generation()
    assert after["running"] == 0 and after["kv_bytes_used"] == 0  # the cache is back to idle
    assert int(after["tokens_generated"]) - int(before["tokens_generated"]) <= 3 + 5  # a few steps past 3

    def counted() -> bool:  # /metrics reads the heartbeats the gateway last fetched: allow it a refresh
        metrics = httpx.get(gen.url + "/metrics").text
        return bool(re.search(r'^vramguard_generation_cancelled_total\{[^}]*\} [1-9]', metrics, re.M)
                    and re.search(r"^vramguard_kv_cache_used_bytes\{[^}]*\} 0\.0$", metrics, re.M))

    await wait_until(counted, 30, interval_s=0.5)


async def test_client_leaving_a_whole_completion_stops_its_sequence(gen: GenStack) -> None:
    """A non-streamed completion of 200 tokens whose client closes the connection once its
    sequence runs: the sequence stops within a few steps and is counted cancelled, not finished."""
    await wait_until(lambda: gen.generation().get("running") == 0, 60)
    before = gen.generation()
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 200, "temperature": 0}
    async with httpx.AsyncClient(base_url=gen.url, timeout=120) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_until(lambda: int(gen.generation().get("tokens_generated", 0)) > int(before["tokens_generated"]), 60)
        request.cancel()  # httpx drops the connection of a request cancelled before its answer
        with pytest.raises(asyncio.CancelledError):
            await request
    at_cancel = int(gen.generation()["tokens_generated"])
    await wait_until(lambda: gen.generation().get("cancelled", 0) == before["cancelled"] + 1, 60)
    after = gen.generation()
    assert after["running"] == 0 and after["kv_bytes_used"] == 0 and after["finished"] == before["finished"]
    assert int(after["tokens_generated"]) - at_cancel <= 8  # a few steps (and one heartbeat's lag) past the cancel


def test_model_page_shows_the_kv_plan(gen: GenStack) -> None:
    workers = httpx.get(gen.url + "/v1/models/smollm2").json()["workers"]
    generation = next(iter(workers.values()))["generation"]  # a JSON object, not JSON text in a string
    plan = generation["kv_plan"]
    # SmolLM2-135M: 2 (keys, values) x 30 layers x 3 kv heads x 64 dims x 4 bytes (float32)
    assert plan["bytes_per_token"] == plan["measured_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert plan["tokens_fit"] > 0 and plan["context_window"] == 2048
    assert {"running", "waiting", "kv_bytes_used", "kv_bytes_reserved", "cancelled", "resumed"} <= set(generation)


async def test_token_latencies_are_histograms_on_metrics(gen: GenStack) -> None:
    """After the generations above: /metrics shows time to first token and time per output token
    as Prometheus histograms (buckets for token latencies, a count per sequence)."""
    httpx.post(gen.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3,
                                                    "temperature": 0}, timeout=120).raise_for_status()

    def shown() -> bool:  # /metrics reads the heartbeats the gateway last fetched: allow it a refresh
        text = httpx.get(gen.url + "/metrics").text
        counts = {name: re.findall(rf'^vramguard_{name}_bucket{{[^}}]*le="\+Inf"[^}}]*}} (\S+)$', text, re.M)
                  for name in ("time_to_first_token_seconds", "time_per_output_token_seconds")}
        return all(values and float(values[0]) >= 1 for values in counts.values()) and \
            'vramguard_time_per_output_token_seconds_bucket{' in text and 'le="0.05"' in text

    await wait_until(shown, 30, interval_s=0.5)


def test_deadline_cuts_a_stream_with_an_error_event(gen: GenStack) -> None:
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", gen.url + "/v1/completions", json=body, headers={"X-Request-Timeout-Ms": "4000"},
                      timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "deadline_exceeded", events[-1]
    assert any(e["choices"][0]["text"] for e in events[:-1])  # tokens were streamed before the cut


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}],
                         ids=["greedy", "seeded"])
async def test_worker_sigkill_mid_stream_loses_and_repeats_nothing(gen: GenStack, sampling: dict[str, object]) -> None:
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 64, **sampling}
    async with httpx.AsyncClient(base_url=gen.url, timeout=300) as client:
        uncrashed = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        parts: list[str] = []
        killed = False
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                parts.append(event["choices"][0]["text"])
                if len(parts) == 10 and not killed:
                    os.kill(gen.worker_pid(), signal.SIGKILL)
                    killed = True
    assert killed
    assert "".join(parts) == uncrashed
    log = gen.worker.worker_log.read_text()
    assert "sequence resumed" in log
    _ready(gen.url, 300)


async def test_worker_recreates_its_group_when_redis_lost_the_stream(gen: GenStack) -> None:
    # As after a Redis restarted empty: the request stream, and its consumer group with it, gone.
    stream = gen.keys.request_stream("smollm2")
    gen.redis.delete(stream)

    def group_back() -> bool:
        return gen.redis.exists(stream) == 1 and any(g["name"] == b"workers" for g in gen.redis.xinfo_groups(stream))

    await wait_until(group_back, 60)
    body = {"model": "smollm2", "prompt": STORY, "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(base_url=gen.url, timeout=300) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
