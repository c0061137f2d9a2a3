"""The bodies of OpenAI's POST /v1/chat/completions and /v1/completions as vramguard serves
them (gateway/protocols/chat.py): the parameters it supports, checked with pydantic; OpenAI parameters it
does not support are refused by name (400), never ignored. Never imports torch.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError, from_json

from vramguard.gateway.edge.checks import BadBodyError
from vramguard.gateway.protocols.schemas import json_fault
from vramguard.shared.errors import InvalidInputError

MAX_MESSAGES = 256
MAX_STOP = 4  # OpenAI's limit

# What the two routes take; any other top-level key is answered 400 naming it (tool calls,
# several choices, logprobs, penalties, response formats, beam search are not supported; NEUTRAL
# below lists the ones accepted at the value that asks for none of it).
COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                    "n", "user"})
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}
TEXT_KEYS = COMMON | {"prompt"}
REQUIRED = frozenset({"model", "messages", "prompt"})  # null is refused for these as for a wrong type
# Parameters many clients send at their neutral value, which asks for nothing this server lacks:
# such a key is dropped; any other value of it is refused like an unsupported parameter.
NEUTRAL = {"logprobs": "false", "presence_penalty": "0", "frequency_penalty": "0"}
# OpenAI's other request parameters: each asks for something this server lacks, except at null,
# which is each one's documented default (clients built from the schema send them so).
OPENAI_UNSUPPORTED = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "top_logprobs",
    "logit_bias", "response_format", "best_of", "echo", "suffix", "service_tier", "store", "metadata",
    "modalities", "audio", "prediction", "reasoning_effort", "web_search_options", "verbosity",
})


StopString = Annotated[StrictStr, Field(min_length=1)]


class Message(BaseModel):
    """One chat message. Role `developer` (OpenAI's newer name for `system`) is read as `system`;
    content given as a list of text parts is their texts joined by newlines (as vLLM joins them)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, value: str) -> str:
        return "system" if value == "developer" else value

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: object) -> object:
        if not isinstance(value, list):
            return value
        if not value:
            raise PydanticCustomError("content_parts", "a list of content parts needs at least one part")
        texts = []
        for part in value:
            if not isinstance(part, dict):
                raise PydanticCustomError("content_part", 'a text part is {"type": "text", "text": "<string>"}')
            kind = part.get("type")
            if kind != "text":
                raise PydanticCustomError("content_part_type", "a content part of type {kind} is not supported by "
                                          "this server (text parts only)", {"kind": repr(kind)[:40]})
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise PydanticCustomError("content_part", 'a text part is {"type": "text", "text": "<string>"}')
            texts.append(part["text"])
        return "\n".join(texts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, value: object) -> object:
        return False if value is None else value  # OpenAI's default


class Sampling(BaseModel):
    """The generation parameters both routes share."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    # Strict: an int is a number, but true or "0.5" is refused as OpenAI refuses it.
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    # int64, as OpenAI documents it; past that the value cannot travel in the msgpack request
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: StopString | list[StopString] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: StrictStr | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_four(cls, value: object) -> object:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise PydanticCustomError("too_many_stop", "at most {limit} stop strings are allowed (OpenAI's limit), "
                                      "not {count}", {"limit": MAX_STOP, "count": len(value)})
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class CompletionRequest(Sampling):
    prompt: Annotated[StrictStr, Field(min_length=1)] | Annotated[
        list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, value: object) -> object:
        # OpenAI's prompt may also be token ids or several prompts (one choice each): name what
        # this server takes rather than the list-length rule the annotation would report.
        if isinstance(value, list) and (len(value) > 1 or any(not isinstance(v, str) for v in value)):
            raise PydanticCustomError("prompt_form", "a string (or a list of one string) is supported; token-id "
                                      "prompts and several prompts are not")
        return value


def _not_json(raw: bytes, detail: str) -> BadBodyError:
    """The 400 for a body the strict parser refused. NaN and (-)Infinity, which Python's json module
    writes and RFC 8259 (section 6) leaves out, get their own message: the parser's "expected value"
    there reads as if the body were garbled."""
    fault = json_fault(detail)
    try:
        from_json(raw, allow_inf_nan=True)
    except ValueError:
        return BadBodyError(f"body is not valid JSON: {fault}")
    where = re.search(r"at line \d+ column \d+", fault)
    return BadBodyError("body is not valid JSON: NaN and Infinity are not JSON numbers (RFC 8259)"
                        f"{' ' + where.group() if where else ''}; send a finite number")


def parse_body(raw: bytes, kind: str) -> ChatRequest | CompletionRequest:
    """The body of a chat ("chat") or completions ("text") request.

    Raises BadBodyError (400) for a body that is not JSON (NaN and Infinity named) or not an object,
    or that names a parameter this server does not support; InvalidInputError (400 on these routes)
    for a value out of range or of the wrong type, naming the field, and for `stream_options`
    without `stream: true`, as OpenAI answers it.
    """
    try:
        # pydantic's parser, not json.loads: it refuses a lone UTF-16 surrogate ("\ud800"), which
        # no tokenizer can encode, and answers nesting past its limit instead of RecursionError.
        data = from_json(raw, allow_inf_nan=False)  # NaN and Infinity are not JSON (RFC 8259)
    except ValueError as exc:
        raise _not_json(raw, str(exc)) from None
    if not isinstance(data, dict):
        raise BadBodyError("body must be a JSON object")
    allowed = CHAT_KEYS if kind == "chat" else TEXT_KEYS
    # null is the default of every optional parameter in OpenAI's schema (n, temperature, stream...)
    data = {k: v for k, v in data.items() if not _is_neutral(k, v) and not (v is None and k in allowed - REQUIRED)}
    unsupported = sorted(k[:60] for k in data if k not in allowed)
    if unsupported:
        first = unsupported[0]
        only = f" (only {NEUTRAL[first]} or null is accepted)" if first in NEUTRAL else ""
        more = f" and {len(unsupported) - 6} more" if len(unsupported) > 6 else ""  # the echo stays short
        others = f"; nor are {', '.join(unsupported[1:6])}{more}" if len(unsupported) > 1 else ""
        raise BadBodyError(f"{first}: not supported by this server{only}{others} "
                           f"(supported: {', '.join(sorted(allowed))})")
    n = data.get("n", 1)
    if n != 1 or isinstance(n, bool):  # true == 1 in Python, not in OpenAI's API
        given = "" if isinstance(n, int) and not isinstance(n, bool) else f" (the integer 1, not {_json_type(n)})"
        raise BadBodyError(f"n: only n = 1 (one choice) is supported{given}")
    try:
        request = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(data)
    except ValidationError as exc:
        error = telling_error(exc.errors())
        path = _field_path(data, error["loc"], missing=error["type"] == "missing")
        raise InvalidInputError(f"{path}: {error['msg']}") from None
    if request.stream_options is not None and not request.stream:  # OpenAI's 400, in its words (vLLM's too)
        raise InvalidInputError("stream_options: The 'stream_options' parameter is only allowed when 'stream' "
                                "is enabled.")
    return request


def _is_neutral(key: str, value: object) -> bool:
    """Whether `key: value` asks for nothing: a NEUTRAL parameter at its neutral value, or one of
    those or of OPENAI_UNSUPPORTED at null (its default)."""
    if value is None:
        return key in NEUTRAL or key in OPENAI_UNSUPPORTED
    if key not in NEUTRAL:
        return False
    if key == "logprobs":
        return value is False
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _json_type(value: object) -> str:
    """The JSON name of `value`'s type, for messages about the body."""
    names = {bool: "a boolean", str: "a string", float: "a number", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def telling_error(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error to report. A value checked against a union (`stop`: a string or a list) fails
    each member; the member of the value's own JSON type says what is wrong with it, while the
    others only say it is not of their type (`*_type` errors), so those come last."""
    return min(errors, key=lambda e: e["type"].endswith("_type"))


def _field_path(data: object, loc: tuple[int | str, ...], *, missing: bool = False) -> str:
    """`loc` as the body's own path (`messages.0.content`): a step that does not index the body
    (the name pydantic gives a union member, such as `constrained-str`) is left out, except the
    last step of a `missing` error, which is the absent field's name."""
    path, value = [], data
    steps = loc[:4]
    for i, step in enumerate(steps):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int):
            value = value[step] if step < len(value) else None
        elif not (missing and i == len(steps) - 1 and isinstance(value, dict)):
            continue
        path.append(str(step))
    return ".".join(path) or "body"
