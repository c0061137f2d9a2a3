"""OpenAI-compatible POST /v1/chat/completions and /v1/completions for generative models,
streamed as server-sent events (`data: {chunk}` lines, then `data: [DONE]`) or answered whole.

The worker sends a request's tokens as chunks on this gateway's reply stream, each with the
offset of its text (worker/generate/progress.py); only text that continues what was forwarded
goes on (gateway/protocols/chunks.py), which is what keeps a stream resumed by another worker
after a crash, or re-sent after a failed publish, free of repeats and gaps. A client that leaves
(or reads slower than `STREAM_BOUND` chunks behind) gets its sequence stopped: the gateway sets
the request's cancel key, which the worker checks every decode step. Never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response, StreamingResponse

from vramguard.gateway.admission.deadline import Deadline
from vramguard.gateway.admission.replies import ReplyStream
from vramguard.gateway.edge.checks import JSON, BadBodyError, header_timeout, read_body, require_media_type
from vramguard.gateway.edge.disconnect import unless_disconnected
from vramguard.gateway.inference import body_checks, check_json_cost, dispatcher_of, inference_request, settings_of
from vramguard.gateway.observe.metrics import RequestRecord
from vramguard.gateway.protocols.chat_schema import ChatRequest, CompletionRequest, parse_body
from vramguard.gateway.protocols.chunks import TextJoin
from vramguard.gateway.protocols.prompt_tokens import PromptTokens
from vramguard.gateway.protocols.render import FastJSONResponse
from vramguard.shared.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    UnavailableError,
    VramguardError,
    error_from_code,
)
from vramguard.shared.models import MAX_CHARS_PER_TOKEN
from vramguard.shared.protocol import ReplyMessage, RequestId

CHAT_PATH = "/v1/chat/completions"
TEXT_PATH = "/v1/completions"
PATHS = (CHAT_PATH, TEXT_PATH)
PROMPT_PARAM = {CHAT_PATH: "messages", TEXT_PATH: "prompt"}  # OpenAI's `param` of a context_length_exceeded
STREAM_BOUND = 4096  # chunks waiting for a slow client before it is cut

router = APIRouter(tags=["openai"])
_background: set[asyncio.Task[None]] = set()  # cancel requests sent after a client left


class ClientTooSlowError(UnavailableError):
    """The client read its stream slower than the gateway could hold it."""


@router.post(CHAT_PATH)
async def chat_completions(request: Request, x_request_timeout_ms: Annotated[str | None, Header()] = None) -> Response:
    """OpenAI chat completions (n = 1; no tools, logprobs or penalties): one assistant message."""
    return await _serve(request, "chat", header_timeout(x_request_timeout_ms))


@router.post(TEXT_PATH)
async def completions(request: Request, x_request_timeout_ms: Annotated[str | None, Header()] = None) -> Response:
    """OpenAI (legacy) completions: the prompt's continuation (n = 1; no echo, suffix, logprobs, best_of)."""
    return await _serve(request, "text", header_timeout(x_request_timeout_ms))


async def _serve(request: Request, kind: str, timeout_ms: int | None) -> Response:
    with body_checks(request):
        require_media_type(request, {JSON})
        raw = await read_body(request, settings_of(request).max_body_bytes)
        await check_json_cost(request, raw)  # before json.loads: 8 MiB of `[],` is a second of the loop's time
        body = parse_body(raw, kind)
    with inference_request(request, body.model) as record:
        settings = settings_of(request)
        spec = settings.spec_for(body.model)
        if not spec.options.get("generates"):
            raise BadBodyError(f"model: {body.model!r} does not generate text")
        if kind == "chat" and spec.options.get("chat") is False:  # a model folder without a chat template
            raise BadBodyError(f"model: {body.model!r} has no chat template; use POST /v1/completions")
        window = int(spec.options.get("context_window", 0)) or None
        prompt, max_tokens = _prompt_and_max_tokens(body, window)
        await _check_window(request, body.model, prompt, max_tokens, window)
        parameters: dict[str, object] = {"temperature": body.temperature, "top_p": body.top_p,
                                         "stop": body.stop_list()}
        if max_tokens is not None:  # else the worker generates up to the room the window leaves
            parameters["max_tokens"] = max_tokens
        if body.seed is not None:
            parameters["seed"] = body.seed
        dispatcher = dispatcher_of(request)
        timeout_ms = timeout_ms or dispatcher.config_for(body.model).default_timeout_ms
        request_id = RequestId(str(record.request_id))
        stream = await dispatcher.open_stream(body.model, [prompt], parameters, timeout_ms, request_id, STREAM_BOUND)
        deadline = time.monotonic() + timeout_ms / 1000
        view = _View(kind, body.model, request_id)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            first = await _opening(request, body.model, stream, deadline, request_id)
            record.streamed = True  # counted when the stream ends, under how it ended (_events)
            return StreamingResponse(_events(request, stream, view, deadline, usage, first, record),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        try:
            text, last = await unless_disconnected(request, _collect(stream, deadline, request_id))
        except BaseException:
            await dispatcher.close_stream(body.model, request_id, cancel=True)
            raise
        await dispatcher.close_stream(body.model, request_id, cancel=False)
        return FastJSONResponse(view.whole(text, last))


def _prompt_and_max_tokens(body: ChatRequest | CompletionRequest, window: int | None) -> tuple[object, int | None]:
    """The prompt as the worker takes it (messages or a string) and max_tokens (None: not given;
    the worker then generates up to the room the window leaves, as vLLM does). Raises
    ContextLengthExceededError when the prompt's characters cannot fit the window (the tokens, and
    the prompt's plus max_tokens, are checked exactly by `_check_window`, or by the worker before
    generating when this gateway cannot count them: OpenAI's error and wording either way)."""
    if isinstance(body, ChatRequest):
        prompt: object = [m.model_dump(exclude_none=True, exclude={"name"}) for m in body.messages]
        chars = sum(len(m.content) for m in body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
    else:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        chars = len(str(prompt))
        max_tokens = body.max_tokens
    if window is not None and chars > window * MAX_CHARS_PER_TOKEN:
        field = "messages" if isinstance(body, ChatRequest) else "prompt"
        raise ContextLengthExceededError(f"This model's maximum context length is {window} tokens. However, your "
                                         f"{field} ({chars} characters) cannot fit in it. Please reduce the length "
                                         f"of the {field}.")
    return prompt, max_tokens


async def _check_window(request: Request, model: str, prompt: object, max_tokens: int | None,
                        window: int | None) -> None:
    """ContextLengthExceededError (OpenAI's) when the prompt's tokens (counted as the worker
    counts them, when this gateway can: gateway/protocols/prompt_tokens.py), plus max_tokens when
    given, pass the context window; without max_tokens, when the prompt leaves no room."""
    counter: PromptTokens = request.app.state.prompt_tokens
    tokens = await counter.count(model, prompt) if window is not None else None
    if tokens is None or window is None:
        return
    if tokens + (max_tokens or 0) > window or max_tokens is None and tokens >= window:
        raise ContextLengthExceededError.of(window, tokens, max_tokens, chat=not isinstance(prompt, str))


async def _next_reply(stream: ReplyStream, deadline: float) -> ReplyMessage:
    """The stream's next reply. Raises DeadlineExceededError, ClientTooSlowError; a cancel of the
    task (the client left) always propagates. Not asyncio.wait_for: on Python 3.11 it returns the
    reply when the cancel lands as the reply arrives, and a whole completion's reading then goes
    on to its end for a client that left."""
    try:
        with Deadline(deadline - time.monotonic()):
            reply = await stream.queue.get()
    except TimeoutError:
        raise DeadlineExceededError("the generation did not finish before its deadline") from None
    if stream.overflowed:
        raise ClientTooSlowError(f"the client read more than {STREAM_BOUND} chunks behind; stream cut")
    return reply


async def _opening(request: Request, model: str, stream: ReplyStream, deadline: float,
                   request_id: RequestId) -> ReplyMessage:
    """A streamed request's first reply, awaited before the response starts: a refusal (a prompt
    the worker counted over the window, a deadline, no room even alone) is then answered with its
    own HTTP status and OpenAI's error body, as OpenAI answers a streamed request it refuses, not
    as an event after a 200. Raises the worker's error (with the request id)."""
    dispatcher = dispatcher_of(request)
    open_streams(request.app)[request_id] = stream  # a gateway shutting down ends this wait too
    try:
        reply = await unless_disconnected(request, _next_reply(stream, deadline))
    except BaseException:
        open_streams(request.app).pop(request_id, None)
        await dispatcher.close_stream(model, request_id, cancel=True)
        raise
    if not reply.ok:
        open_streams(request.app).pop(request_id, None)
        await dispatcher.close_stream(model, request_id, cancel=False)
        raise error_from_code(reply.error_code or "model_error", reply.error_message or "", request_id=request_id)
    return reply


async def _chunks(stream: ReplyStream, deadline: float, request_id: str,
                  first: ReplyMessage | None = None) -> AsyncIterator[dict[str, object]]:
    """The request's chunks in order (`first`, when the caller already took it, then the
    stream's), cut so that each character comes once (TextJoin); ends after the chunk with a
    finish_reason. Raises the worker's error, DeadlineExceededError (a gap never filled ends so
    too), ClientTooSlowError, StreamGapError."""
    join = TextJoin(request_id, STREAM_BOUND)
    reply = first
    while True:
        if reply is None:
            reply = await _next_reply(stream, deadline)
        if not reply.ok:
            raise error_from_code(reply.error_code or "model_error", reply.error_message or "")
        chunk = reply.outputs[0] if reply.outputs else None
        reply = None
        if not isinstance(chunk, dict):
            continue
        for forwarded in join.add(chunk):
            yield forwarded
        if join.finished:
            return


async def _collect(stream: ReplyStream, deadline: float, request_id: str) -> tuple[str, dict[str, object]]:
    parts: list[str] = []
    last: dict[str, object] = {}
    async for chunk in _chunks(stream, deadline, request_id):
        parts.append(str(chunk["text"]))
        last = chunk
    return "".join(parts), last


async def _events(request: Request, stream: ReplyStream, view: _View, deadline: float,
                  include_usage: bool, first: ReplyMessage, record: RequestRecord) -> AsyncIterator[bytes]:
    """The SSE body, from the stream's `first` reply on (_opening took it). Whatever ends it
    early (the client leaving cancels this generator; an error) stops the worker's sequence
    through its cancel key. The request is counted and logged (`record.end`) under how the
    stream ended: served, the error its last event carried, or cancelled (the client left)."""
    dispatcher = dispatcher_of(request)
    finished = False
    ended_by: BaseException | None = None
    open_streams(request.app)[view.request_id] = stream  # a shutting-down gateway ends it (end_open_streams)
    try:
        yield _sse(view.delta("", None, first=True))
        async for chunk in _chunks(stream, deadline, view.request_id, first):
            yield _sse(view.delta(str(chunk["text"]), chunk["finish_reason"]))
            if chunk["finish_reason"] is not None and include_usage:
                yield _sse(view.usage_only(chunk))
        finished = True
        yield b"data: [DONE]\n\n"
    except VramguardError as exc:
        ended_by = exc
        yield _sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code,
                              "request_id": view.request_id}})
    except (asyncio.CancelledError, GeneratorExit):  # the client left: counted "cancelled", re-raised
        ended_by = asyncio.CancelledError()
        raise
    except Exception as exc:
        ended_by = exc
        raise
    finally:
        if record.end is not None:
            record.end(ended_by)
        open_streams(request.app).pop(view.request_id, None)
        task = asyncio.get_running_loop().create_task(
            dispatcher.close_stream(view.model, view.request_id, cancel=not finished))
        _background.add(task)
        task.add_done_callback(_background.discard)


def open_streams(app: Any) -> dict[RequestId, ReplyStream]:
    """The SSE streams this gateway is sending now, by request id (on app.state)."""
    streams: dict[RequestId, ReplyStream] | None = getattr(app.state, "open_sse_streams", None)
    if streams is None:
        streams = app.state.open_sse_streams = {}
    return streams


async def end_open_streams(app: Any, timeout_s: float) -> None:
    """A gateway shutting down (after its shutdown delay): each open SSE stream ends with an
    error event in OpenAI's shape (`unavailable`) instead of a cut connection, and its sequence is
    cancelled; waits up to `timeout_s` for the streams to send it."""
    streams = open_streams(app)
    for request_id, stream in list(streams.items()):
        stream.put(ReplyMessage.failure(request_id, UnavailableError.code,
                                        "the gateway is shutting down; retry the request"))
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while streams and loop.time() < until:
        await asyncio.sleep(0.05)


def _sse(data: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class _View:
    """OpenAI's shapes for one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, kind: str, model: str, request_id: RequestId) -> None:
        self.kind, self.model, self.request_id = kind, model, request_id
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, object]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def delta(self, text: str, finish_reason: object, *, first: bool = False) -> dict[str, object]:
        if self.kind == "chat":
            delta: dict[str, object] = {"role": "assistant", "content": ""} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_only(self, last: dict[str, object]) -> dict[str, object]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": _usage(last)}

    def whole(self, text: str, last: dict[str, object]) -> dict[str, object]:
        reason = last.get("finish_reason")
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": _usage(last)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": _usage(last)}


def _usage(last: dict[str, object]) -> dict[str, int]:
    prompt = int(last.get("prompt_tokens", 0))  # type: ignore[call-overload]
    completion = int(last.get("completion_tokens", 0))  # type: ignore[call-overload]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
