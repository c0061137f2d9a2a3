"""gateway/edge/bodycost.py: the count of a body's JSON values, exact for JSON and a bound for what a
parser builds from a body that is not; JsonCounter with its real helper process: a large body is
counted there, and closing it at shutdown leaves no thread of its pool behind."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Any

import pytest

from vramguard.gateway.edge.bodycost import INLINE_BYTES, PREFIX_BYTES, JsonCounter, count_json_values
from vramguard.shared.errors import PayloadTooLargeError, UnavailableError


def values_in(document: Any) -> int:
    """The count as the docstring defines it, from the parsed document: every scalar, list and object."""
    if isinstance(document, list):
        return 1 + sum(values_in(item) for item in document)
    if isinstance(document, dict):
        return 1 + sum(values_in(item) for item in document.values())
    return 1


def random_document(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice("lods" if depth < 4 else "ns")
    if kind == "l":
        return [random_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "o":
        return {rng.choice(['k', 'a,b', '[{', '"q"', '\\']) + str(i): random_document(rng, depth + 1)
                for i in range(rng.randrange(4))}
    if kind == "n":
        return rng.choice([0, -1.5e3, True, None])
    return "".join(rng.choice(['x', ',', '[', ']', '{', '}', '"', '\\', '\\"', ' ', '\u00e9']) for _ in range(6))


@pytest.mark.parametrize("seed", range(20))
def test_the_count_of_a_json_document_is_its_number_of_values(seed: int) -> None:
    """Brackets, commas, quotes and backslashes inside strings and keys, whitespace inside empty lists:
    the structural count decides as the parsed document's count does, at the limit and one below it."""
    rng = random.Random(seed)
    document = [random_document(rng) for _ in range(20)]
    for indent in (None, 1):
        body = json.dumps(document, indent=indent, ensure_ascii=seed % 2 == 0).encode()
        exact = values_in(document)
        assert count_json_values(body, limit=exact) <= exact
        assert count_json_values(body, limit=exact - 1) == exact


@pytest.mark.parametrize("cut", [1, 2, 7])
def test_a_body_that_is_not_json_is_bounded_by_what_a_parser_builds_before_its_error(cut: int) -> None:
    """8 MiB of nested empty lists whose last bytes are missing (the closing `]}`, a `}` only...):
    json.loads would build 2.8 million lists before it meets the end; the count says more than the
    limit, from the body's first PREFIX_BYTES, without parsing it."""
    pairs = 8 * 2**20 // 5
    whole = b'{"model": "m", "messages": [' + b"[[]]," * pairs + b"[[]]]}"
    body = whole[:-cut]
    counted = count_json_values(body, limit=65_536)
    assert 65_536 < counted <= 3 + 2 * (pairs + 1)  # the object, "m", the messages list, its lists
    assert count_json_values(body[:PREFIX_BYTES - 1], limit=65_536) > 65_536
    assert count_json_values(b'{"input": "' + b"[]," * 100_000, limit=10) <= 10  # an unclosed string: 1


def pool_manager_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if type(t).__name__ == "_ExecutorManagerThread"}


async def test_aclose_returns_once_the_pools_manager_thread_has_ended() -> None:
    """A manager thread still running at interpreter exit races concurrent.futures' exit hook
    for its wake-up pipe (an occasional "Bad file descriptor" at the gateway's exit)."""
    before = pool_manager_threads()
    counter = JsonCounter(max_values=100)
    counter.start()
    body = b"[" + b"1," * (INLINE_BYTES // 2) + b"1]"  # over INLINE_BYTES: counted in the helper
    with pytest.raises(PayloadTooLargeError, match="more than the 100"):
        await counter.check(body)
    assert pool_manager_threads() - before  # the pool is up, with its manager thread
    await counter.aclose()
    assert not pool_manager_threads() - before


async def test_aclose_abandons_a_count_instead_of_waiting_for_it() -> None:
    """Shutdown must not wait seconds for a count nobody will read: the helper is killed, and the
    request whose body was queued for it or being counted gets an error, never the count's verdict."""
    counter = JsonCounter(max_values=100)
    counter.start()
    huge = b"[" + b"[]," * (8 * 2**20 // 3) + b"[]]"  # 8 MiB: queued behind the helper's start (a second)
    counting = asyncio.create_task(counter.check(huge))
    await asyncio.sleep(0.1)  # the body is handed to the pool
    await counter.aclose()
    with pytest.raises((UnavailableError, asyncio.CancelledError)):
        await counting
