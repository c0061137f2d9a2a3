"""The HTTP call of the external-engine backends (openai_engine.py, kserve_engine.py), with one
mapping of an engine's failures to vramguard's errors:

    refused, reset, timed out, 5xx, 429   UnavailableError (503 for the batch; the next batch tries again)
    404                                    UnavailableError too: the engine is up but the model is not
                                           (yet) loaded, as while Triton restarts; a wrong model name
                                           is caught at start, where the warmup meets it
    400, 413, 422                          InvalidInputError (422; the batch is retried item by item,
                                           so only the input the engine refuses fails)
    any other status, a body not JSON      ModelError (500)
"""

from __future__ import annotations

import httpx

from vramguard.shared.errors import InvalidInputError, ModelError, UnavailableError

REFUSED_INPUT = frozenset({400, 413, 422})


def post_json(client: httpx.Client, url: str, body: object) -> object:
    """POST `body` as JSON to `url`; the answer's JSON. Raises as the module docstring says, each
    message naming the engine's URL and, for an answer, its status and the start of its body."""
    try:
        response = client.post(url, json=body)
    except httpx.TransportError as exc:
        raise UnavailableError(f"engine at {url} is unreachable ({type(exc).__name__}: {exc})") from None
    status, text = response.status_code, response.text[:200]
    if status in (404, 429) or status >= 500:
        raise UnavailableError(f"engine at {url} answered {status}: {text}")
    if status in REFUSED_INPUT:
        raise InvalidInputError(f"the engine refused the input ({status}): {text}")
    if status != 200:
        raise ModelError(f"engine at {url} answered {status}: {text}")
    try:
        return response.json()
    except ValueError:
        raise ModelError(f"engine at {url} answered 200 with a body that is not JSON: {text}") from None
