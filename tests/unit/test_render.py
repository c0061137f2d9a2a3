"""gateway/protocols/render.py: reply bodies written from numpy arrays read back as the same values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vramguard.gateway.protocols.render import json_bytes


def test_float32_arrays_read_back_as_the_same_float32_values() -> None:
    outputs = [np.random.default_rng(0).random(384, dtype=np.float32) for _ in range(3)]
    body = json.loads(json_bytes({"outputs": outputs}))
    np.testing.assert_array_equal(np.asarray(body["outputs"], dtype=np.float32), np.stack(outputs))


def test_what_orjson_does_not_write_itself_falls_back_to_lists() -> None:
    strided = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not C-contiguous
    half = np.array([0.5, 1.5], dtype=np.float16)
    body = json.loads(json_bytes({"a": strided, "b": half, "c": np.float32(0.25), "d": np.int64(3)}))
    assert body == {"a": [[0, 2], [4, 6], [8, 10]], "b": [0.5, 1.5], "c": 0.25, "d": 3}


def test_non_finite_numbers_become_null_and_bytes_are_refused() -> None:
    assert json.loads(json_bytes([np.array([np.nan, np.inf], dtype=np.float32)])) == [[None, None]]
    with pytest.raises(TypeError):
        json_bytes({"outputs": [b"raw"]})
