"""Gateway validation: bad bodies are 400/422 with a message that names the problem."""

from __future__ import annotations

import numpy as np
import pytest

from vramguard.gateway.protocols.schemas import BodyNotJsonError, jsonable, parse_infer_request, validate_inputs
from vramguard.shared.errors import InvalidInputError
from vramguard.shared.models import CATALOGUE


def test_valid_body() -> None:
    req = parse_infer_request(b'{"inputs": ["a", "b"], "timeout_ms": 500}')
    assert req.inputs == ["a", "b"] and req.timeout_ms == 500


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b'{"inputs": [1,]}'])
def test_unparseable_body_is_400(body: bytes) -> None:
    with pytest.raises(BodyNotJsonError) as info:
        parse_infer_request(body)
    assert info.value.http_status == 400


@pytest.mark.parametrize(
    "body",
    [b"[]", b"{}", b'{"inputs": []}', b'{"inputs": "text"}', b'{"inputs": ["a"], "timeout_ms": 0}',
     b'{"inputs": ["a"], "extra": 1}'],
)
def test_schema_violations_are_422(body: bytes) -> None:
    with pytest.raises(InvalidInputError) as info:
        parse_infer_request(body)
    assert info.value.http_status == 422


@pytest.mark.parametrize("inputs", [[1], ["ok", ""], ["   "], [None], [["a"]]])
def test_text_model_rejects_non_strings_and_blanks(inputs: list[object]) -> None:
    with pytest.raises(InvalidInputError, match=r"inputs\[\d\]"):
        validate_inputs(CATALOGUE["minilm"], inputs)  # type: ignore[arg-type]


def test_json_model_rejects_non_finite_numbers() -> None:
    req = parse_infer_request(b'{"inputs": [[1.0, NaN]]}')
    with pytest.raises(InvalidInputError, match="non-finite"):
        validate_inputs(CATALOGUE["synthetic"], req.inputs)


def test_jsonable_turns_arrays_into_lists() -> None:
    assert jsonable([np.array([1.5, 2.0], dtype=np.float32), {"k": np.arange(2)}]) == [[1.5, 2.0], {"k": [0, 1]}]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b'{"inputs": ["a"], "parameters": {"x": 123456789012345678901234567890}}', "parameters.x"),
        (b'{"inputs": [18446744073709551616]}', r"inputs\[0\]"),
        (b'{"inputs": [1, [{"k": -9223372036854775809}]]}', r"inputs\[1\]"),
    ],
)
def test_integers_the_wire_cannot_carry_are_422(body: bytes, where: str) -> None:
    with pytest.raises(InvalidInputError, match=f"{where}: integer .* outside the range") as info:
        parse_infer_request(body)
    assert info.value.http_status == 422


def test_integers_at_the_wire_limits_are_accepted() -> None:
    req = parse_infer_request(b'{"inputs": [18446744073709551615, -9223372036854775808]}')
    assert req.inputs == [2**64 - 1, -(2**63)]


@pytest.mark.parametrize("timeout", [b"true", b'"100"', b"100.0"])
def test_body_timeout_must_be_a_json_integer(timeout: bytes) -> None:
    with pytest.raises(InvalidInputError, match="timeout_ms"):
        parse_infer_request(b'{"inputs": ["a"], "timeout_ms": ' + timeout + b"}")
