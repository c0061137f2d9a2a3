"""Reply bodies as JSON bytes straight from the workers' numpy arrays: orjson writes a float32
[n, 384] embedding from the array's buffer, without a Python float object per number (what
`ndarray.tolist()` + the standard json module cost: several ms for a 32 x 384 reply)."""

from __future__ import annotations

import numpy as np
import orjson
from starlette.responses import Response

from vramguard.gateway.protocols.schemas import jsonable

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _fallback(value: object) -> object:
    """What orjson does not write itself: arrays it refuses (non-contiguous, a dtype it lacks such
    as float16 on some builds) and numpy scalars, as `jsonable` renders them. Raises TypeError
    for anything else (bytes: a reply that cannot be JSON)."""
    if isinstance(value, np.ndarray | np.generic):
        return jsonable(value.tolist() if isinstance(value, np.generic) else value)
    raise TypeError(f"{type(value).__name__} cannot be rendered as JSON")


def json_bytes(payload: object) -> bytes:
    """`payload` (dicts, lists, str, numbers, numpy arrays) as compact JSON. A float32 is written
    with the shortest text that reads back as the same float32. NaN and infinity become null
    (JSON has neither). Raises TypeError for a value JSON cannot carry."""
    return orjson.dumps(payload, default=_fallback, option=_OPTIONS)


class FastJSONResponse(Response):
    """A JSON response rendered by `json_bytes` (Starlette's JSONResponse goes through json.dumps)."""

    media_type = "application/json"

    def render(self, content: object) -> bytes:
        return json_bytes(content)
