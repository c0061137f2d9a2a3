"""The context window of a generative model, through the real `openai` client, a gateway process and
a synthetic-LM worker process (worker/generate/synthetic_lm.py: never stops by itself, one token
per word of the prompt) with a 64-token window: a request without max_tokens generates up to the
room the window leaves (as vLLM does); a prompt that does not fit gets OpenAI's 400
context_length_exceeded, its wording and its `param`, so that clients keyed on them (LiteLLM's
ContextWindowExceededError) react as they do with OpenAI."""

from __future__ import annotations

import itertools
from pathlib import Path

import openai
import pytest

from tests.helpers import Stack, synthetic_lm_models

MODEL = "simlm"
WINDOW = 64


@pytest.fixture
async def client(stack: Stack, tmp_path: Path) -> openai.AsyncOpenAI:
    models = synthetic_lm_models(tmp_path, window=WINDOW)
    common = {"models_file": str(models), "served_models": MODEL}
    stack.start_gateway(**common)
    stack.start_worker(model=MODEL, **common)
    await stack.wait_ready()
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.mark.slow  # two processes' start and 20 requests: about 20 s on 2 busy cores
@pytest.mark.timeout(180)
async def test_context_window_room_and_openai_context_length_exceeded(client: openai.AsyncOpenAI) -> None:
    """1. Without max_tokens a 3-token prompt generates the 61 tokens the window leaves, on both routes.
    2. A 60-token prompt with max_tokens 10 (70 > 64), a 3-token prompt with max_tokens 64 (the
       window alone), and a 64-token prompt without max_tokens (no room left), on both routes,
       streamed or not.
    Result: 1 finishes with "length" after 61 tokens; each of 2 raises openai.BadRequestError (400)
    with code context_length_exceeded, type invalid_request_error, param messages or prompt, and
    OpenAI's message, streamed too (the worker counted the tokens: the gateway waits for a
    streamed request's first reply before it answers 200)."""
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a bb ccc"}],
                                                temperature=0)
    text = await client.completions.create(model=MODEL, prompt="a bb ccc", temperature=0)
    for answer in (chat, text):
        assert answer.usage is not None and answer.choices[0].finish_reason == "length"
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, WINDOW - 3)

    words60, words64 = " ".join(["w"] * 60), " ".join(["w"] * WINDOW)
    head = f"This model's maximum context length is {WINDOW} tokens."
    refused = [
        ("messages", dict(messages=[{"role": "user", "content": words60}], max_tokens=10),
         f"{head} However, you requested 70 tokens (60 in the messages, 10 in the completion). "
         "Please reduce the length of the messages or completion."),
        ("messages", dict(messages=[{"role": "user", "content": "a bb ccc"}], max_tokens=WINDOW),
         f"{head} However, you requested 67 tokens (3 in the messages, 64 in the completion). "
         "Please reduce the length of the messages or completion."),
        ("messages", dict(messages=[{"role": "user", "content": words64}]),
         f"{head} However, your messages resulted in 64 tokens. Please reduce the length of the messages."),
        ("prompt", dict(prompt=words60, max_tokens=10),
         f"This model's maximum context length is {WINDOW} tokens, however you requested 70 tokens (60 in your "
         "prompt; 10 for the completion). Please reduce your prompt; or completion length."),
        ("prompt", dict(prompt="a bb ccc", max_tokens=WINDOW),
         f"This model's maximum context length is {WINDOW} tokens, however you requested 67 tokens (3 in your "
         "prompt; 64 for the completion). Please reduce your prompt; or completion length."),
        ("prompt", dict(prompt=words64),
         f"{head} However, your prompt resulted in 64 tokens. Please reduce the length of the prompt."),
    ]
    for (param, body, message), stream in itertools.product(refused, (False, True)):
        create = client.chat.completions.create if param == "messages" else client.completions.create
        with pytest.raises(openai.BadRequestError) as caught:
            await create(model=MODEL, temperature=0, stream=stream, **body)  # type: ignore[call-overload]
        error = caught.value
        assert error.status_code == 400 and error.code == "context_length_exceeded", error.body
        assert error.param == param and error.type == "invalid_request_error", error.body
        assert isinstance(error.body, dict) and error.body["message"] == message, error.body
    await client.close()
