"""The error tree every client-visible failure belongs to, with its wire `code` and HTTP status.

    VramguardError                 500 internal
    ├── InvalidInputError          422 invalid_input      (400 for an unparseable body)
    ├── UnauthorizedError          401 unauthorized
    ├── ModelNotFoundError         404 model_not_found
    ├── PayloadTooLargeError       413 payload_too_large
    ├── InputTooLargeError         413 input_too_large
    ├── InputTooLongError          413 input_too_long     (past the model's token window)
    ├── ContextLengthExceededError 400 context_length_exceeded (a generation's prompt + completion)
    ├── UnsupportedMediaTypeError  415 unsupported_media_type
    ├── QueueFullError             429 queue_full         (carries retry_after_s)
    ├── ModelError                 500 model_error
    ├── UnavailableError           503 unavailable
    └── DeadlineExceededError      504 deadline_exceeded

Workers send only `code` and `message` on the wire; `error_from_code` rebuilds the class.
"""

from __future__ import annotations


class VramguardError(Exception):
    """Root of every error a client can see; the table above; docs/reference/api/index.md lists the statuses."""

    code: str = "internal"
    http_status: int = 500

    def __init__(self, message: str, *, request_id: str | None = None, detail: str | None = None) -> None:
        """`message` is sent to the client; `detail` (hostnames, addresses, a library's exception
        text) only goes to the request's log line."""
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.detail = detail


class InvalidInputError(VramguardError):
    """The body or an input breaks the model's schema: wrong type, empty, non-finite, bad shape."""

    code = "invalid_input"
    http_status = 422


class UnauthorizedError(VramguardError):
    code = "unauthorized"
    http_status = 401


class ModelNotFoundError(VramguardError):
    code = "model_not_found"
    http_status = 404


class PayloadTooLargeError(VramguardError):
    code = "payload_too_large"
    http_status = 413


class InputTooLargeError(VramguardError):
    """An input that cannot fit the worker's memory budget even in a batch of one."""

    code = "input_too_large"
    http_status = 413


class InputTooLongError(InvalidInputError):
    """A text input longer than the model's token window, and the request did not opt into
    truncation. An InvalidInputError, so a worker answers it per request like other bad inputs."""

    code = "input_too_long"
    http_status = 413

    # Every message of this error ends with how to opt in, in the native request's terms; the OpenAI
    # routes rewrite `parameters.truncate=true` into their body's `"truncate": true`.
    HINT = "shorten it or set parameters.truncate=true to cut it"


class ContextLengthExceededError(InvalidInputError):
    """A generation whose prompt, or prompt plus max_tokens, does not fit the model's context
    window. Code, status and wording are OpenAI's, so that clients which key on them (the `openai`
    client's BadRequestError.code, LiteLLM's ContextWindowExceededError) react as they do with
    OpenAI; the OpenAI routes add `param` ("messages" or "prompt")."""

    code = "context_length_exceeded"
    http_status = 400

    @classmethod
    def of(cls, window: int, prompt_tokens: int, max_tokens: int | None, *, chat: bool) -> ContextLengthExceededError:
        """The error for a prompt of `prompt_tokens` and `max_tokens` (None: not given) against a
        window of `window` tokens, in OpenAI's words for chat messages or a completions prompt."""
        head = f"This model's maximum context length is {window} tokens."
        if max_tokens is None:
            what = "messages" if chat else "prompt"
            return cls(f"{head} However, your {what} resulted in {prompt_tokens} tokens. "
                       f"Please reduce the length of the {what}.")
        total = prompt_tokens + max_tokens
        if chat:
            return cls(f"{head} However, you requested {total} tokens ({prompt_tokens} in the messages, "
                       f"{max_tokens} in the completion). Please reduce the length of the messages or completion.")
        return cls(f"{head[:-1]}, however you requested {total} tokens ({prompt_tokens} in your prompt; {max_tokens} "
                   "for the completion). Please reduce your prompt; or completion length.")


class UnsupportedMediaTypeError(VramguardError):
    """A body in a Content-Type or Content-Encoding the route does not take."""

    code = "unsupported_media_type"
    http_status = 415


class QueueFullError(VramguardError):
    """The model's queued + in-flight entries are over `queue_bound`; nothing was enqueued."""

    code = "queue_full"
    http_status = 429

    def __init__(
        self, message: str, *, retry_after_s: int = 1, request_id: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id, detail=detail)
        self.retry_after_s = retry_after_s


class ModelError(VramguardError):
    """The model raised on this input (or returned the wrong number of outputs)."""

    code = "model_error"
    http_status = 500


class UnavailableError(VramguardError):
    """Redis is unreachable, or no live worker serves the model."""

    code = "unavailable"
    http_status = 503


class InternalError(VramguardError):
    """A bug in vramguard itself (not the model): e.g. a worker's batch task raised. Never retried."""

    code = "internal"
    http_status = 500


class DeadlineExceededError(VramguardError):
    """The request was not answered before its `deadline_ms`."""

    code = "deadline_exceeded"
    http_status = 504


_BY_CODE: dict[str, type[VramguardError]] = {
    cls.code: cls
    for cls in (
        InvalidInputError,
        UnauthorizedError,
        ModelNotFoundError,
        PayloadTooLargeError,
        InputTooLargeError,
        InputTooLongError,
        ContextLengthExceededError,
        UnsupportedMediaTypeError,
        QueueFullError,
        ModelError,
        UnavailableError,
        DeadlineExceededError,
        InternalError,
    )
}


def error_from_code(code: str, message: str, *, request_id: str | None = None) -> VramguardError:
    """Rebuild the error a worker reported by its wire `code`; an unknown code becomes `ModelError`."""
    cls = _BY_CODE.get(code, ModelError)
    return cls(message, request_id=request_id)


def all_error_classes() -> dict[str, type[VramguardError]]:
    """Every client-visible error class by its code (a copy; for tests and docs)."""
    return dict(_BY_CODE)
