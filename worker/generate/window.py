"""The context window of one generation: how many tokens it may generate when the request names
no max_tokens, and OpenAI's refusal of a prompt that does not fit (docs/concepts/streams.md).
Pure: no Redis, no torch."""

from __future__ import annotations

from vramguard.shared.errors import ContextLengthExceededError


def completion_bound(prompt_tokens: int, max_tokens: int | None, window: int, cache_tokens: int, *,
                     chat: bool) -> int:
    """The completion's bound in tokens: `max_tokens` when the request gives it, else the room the
    context window leaves after the prompt, as vLLM does, and no more than `cache_tokens` (what the
    KV plan holds for one sequence, prompt included) leaves.

    Args:
        prompt_tokens: the prompt's tokens, as the worker counts them (chat template included).
        max_tokens: the request's max_tokens, or None.
        window: the model's context window, tokens (options.context_window, at most the model's own).
        cache_tokens: KVPlan.tokens_fit.
        chat: the prompt came as chat messages (OpenAI's wording names "messages", else "prompt").

    Raises:
        ContextLengthExceededError: the prompt, or the prompt plus `max_tokens`, does not fit the window.
    """
    if max_tokens is None:
        if prompt_tokens >= window:
            raise ContextLengthExceededError.of(window, prompt_tokens, None, chat=chat)
        return max(1, min(window, cache_tokens) - prompt_tokens)
    if prompt_tokens + max_tokens > window:
        raise ContextLengthExceededError.of(window, prompt_tokens, max_tokens, chat=chat)
    return max_tokens
