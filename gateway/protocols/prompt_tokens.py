"""Counting a generative model's prompt tokens in the gateway, so that a prompt plus max_tokens
beyond the model's context window is refused before it is queued. The tokenizer and chat
template come from Redis, where the model's worker puts them at start (worker/generate/loop.py);
they are read with the worker's own rule (shared/prompt_encoding.py: the `tokenizers` library
and transformers' chat-template renderer, which import no torch), so both count the same tokens.
Where those libraries are not installed, or no worker has published yet, the count is None and
the worker checks the window instead (before generating anything). Never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.keys import Keys

log = logging.getLogger(__name__)


class _Counter:
    def __init__(self, fields: dict[bytes, bytes]) -> None:
        from vramguard.shared.prompt_encoding import PromptEncoder  # imports tokenizers and transformers

        self._encoder = PromptEncoder.from_description({k.decode(): v.decode() for k, v in fields.items()})

    def count(self, prompt: object) -> int:
        """Tokens of a string prompt, or of chat messages rendered with the assistant's turn opened,
        by the worker's own rule (shared/prompt_encoding.py: contents as text). Raises
        InvalidInputError where the worker would refuse the prompt."""
        return len(self._encoder.encode(cast(str | list[dict[str, str]], prompt)))


class PromptTokens:
    """Per model, a counter built once from what its worker published (retried while absent)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._counters: dict[str, _Counter] = {}
        self._loading: dict[str, asyncio.Lock] = {}

    async def count(self, model: str, prompt: object) -> int | None:
        """The prompt's tokens as `model`'s worker counts them, or None when the gateway cannot count."""
        counter = self._counters.get(model) or await self._load_once(model)
        if counter is None:
            return None
        return await asyncio.to_thread(counter.count, prompt)  # a long prompt takes milliseconds

    async def _load_once(self, model: str) -> _Counter | None:
        """One build at a time per model, the requests that arrive meanwhile waiting for it: a build
        holds the GIL for about 0.1 s (a 1.5 MB tokenizer) after a 1 s import, and a cold gateway's
        burst that built one each starved the event loop past its Redis deadline (503s)."""
        async with self._loading.setdefault(model, asyncio.Lock()):
            return self._counters.get(model) or await self._load(model)

    async def _load(self, model: str) -> _Counter | None:
        try:
            fields = cast(dict[bytes, bytes], await self._redis.hgetall(self._keys.tokenizer(model)))
        except RedisError:
            return None
        if not fields:
            return None
        try:
            counter = await asyncio.to_thread(_Counter, fields)
        except ImportError:
            return None  # a gateway without tokenizers/transformers: the worker checks the window
        except Exception as exc:  # noqa: BLE001 - a tokenizer we cannot read costs only the early check
            log.warning("cannot read the published tokenizer", extra={"model": model, "error": str(exc)})
            return None
        self._counters[model] = counter
        return counter
