"""The bodies of OpenAI's POST /v1/chat/completions and /v1/completions as vramguard serves
them (gateway/chat.py): the parameters it supports, checked with pydantic; OpenAI parameters it
does not support are refused by name (400), never ignored. Never imports torch.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from vramguard.gateway.edge import BadBodyError
from vramguard.shared.errors import InvalidInputError

MAX_MESSAGES = 256
MAX_STOP = 4  # OpenAI's limit
DEFAULT_MAX_TOKENS = {"chat": 256, "text": 16}  # OpenAI's completions default is 16

# What the two routes take; any other top-level key is answered 400 naming it (tool calls,
# several choices, logprobs, penalties, response formats, beam search are not supported).
COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                    "n", "user"})
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}
TEXT_KEYS = COMMON | {"prompt"}


StopString = Annotated[StrictStr, Field(min_length=1)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class Sampling(BaseModel):
    """The generation parameters both routes share."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    # int64, as OpenAI documents it; past that the value cannot travel in the msgpack request
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: StrictStr | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: StrictStr | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class CompletionRequest(Sampling):
    prompt: Annotated[StrictStr, Field(min_length=1)] | Annotated[
        list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)]


def parse_body(raw: bytes, kind: str) -> ChatRequest | CompletionRequest:
    """The body of a chat ("chat") or completions ("text") request.

    Raises BadBodyError (400) for a body that is not UTF-8 JSON or not an object, or that names a
    parameter this server does not support; InvalidInputError (400 on these routes) for a value
    out of range or of the wrong type, naming the field.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadBodyError(f"body is not UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadBodyError("body must be a JSON object")
    allowed = CHAT_KEYS if kind == "chat" else TEXT_KEYS
    unsupported = sorted(k[:60] for k in data if k not in allowed)
    if unsupported:
        raise BadBodyError(f"{unsupported[0]}: not supported by this server: {', '.join(unsupported)} "
                           f"(supported: {', '.join(sorted(allowed))})")
    if data.get("n", 1) != 1:
        raise BadBodyError("n: only n = 1 (one choice) is supported")
    try:
        return (ChatRequest if kind == "chat" else CompletionRequest).model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][:3]) or "body"
        raise InvalidInputError(f"{where}: {first['msg']}") from None
