"""worker/generate/window.py: the completion's bound and OpenAI's context_length_exceeded."""

from __future__ import annotations

import pytest

from vramguard.shared.errors import ContextLengthExceededError
from vramguard.worker.generate.window import completion_bound


def test_without_max_tokens_the_completion_gets_the_room_the_window_leaves() -> None:
    assert completion_bound(100, None, 2048, 1_000_000, chat=True) == 1948
    assert completion_bound(100, None, 2048, 600, chat=True) == 500  # no more than the KV plan holds
    assert completion_bound(2047, None, 2048, 1_000_000, chat=False) == 1
    assert completion_bound(100, 1948, 2048, 1_000_000, chat=True) == 1948


@pytest.mark.parametrize(("prompt", "max_tokens", "chat", "message"), [
    (1515, 1000, True, "This model's maximum context length is 2048 tokens. However, you requested 2515 tokens "
                       "(1515 in the messages, 1000 in the completion). Please reduce the length of the messages "
                       "or completion."),
    (1515, 1000, False, "This model's maximum context length is 2048 tokens, however you requested 2515 tokens "
                        "(1515 in your prompt; 1000 for the completion). Please reduce your prompt; or completion "
                        "length."),
    (2048, None, True, "This model's maximum context length is 2048 tokens. However, your messages resulted in "
                       "2048 tokens. Please reduce the length of the messages."),
])
def test_a_prompt_that_does_not_fit_gets_openais_words(prompt: int, max_tokens: int | None, chat: bool,
                                                       message: str) -> None:
    with pytest.raises(ContextLengthExceededError) as caught:
        completion_bound(prompt, max_tokens, 2048, 1_000_000, chat=chat)
    assert caught.value.message == message
    assert (caught.value.code, caught.value.http_status) == ("context_length_exceeded", 400)
