"""What parsing a JSON body may cost the event loop. Parsing builds one Python object per JSON value,
on the event loop and holding the GIL (pydantic's parser, like every C parser, releases it never):
an 8 MiB body of `[],[],...` is 2.8 million lists, seconds of CPU during which no other client of
the process, health probes included, gets an answer. So a body is parsed on the loop only when it
holds at most `Settings.max_json_values` values (65,536 by default: tens of ms at worst); a larger
body is first counted in a helper process (`JsonCounter`), off the loop, and refused with 413 when
it holds more. The count reads the body's structure (commas and brackets outside strings), not its
values: it holds whatever the body's syntax, so a body that is not JSON (its last `}` missing) is
bounded as a well-formed one is, and nothing is parsed to count it. Bodies up to INLINE_BYTES cannot
hold more than a bounded number of values and are not sent there.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from vramguard.shared.errors import PayloadTooLargeError, UnavailableError

log = logging.getLogger(__name__)

# Below this a body is parsed on the loop without counting: at most INLINE_BYTES / 3 values (`[],`),
# 21,845, a few ms of parsing.
INLINE_BYTES = 64 * 1024


# What a body's count looks at first when it is past the bound: refused from its first MiB, a hostile
# 8 MiB body costs the helper an eighth of a full count (tens of ms, not hundreds).
PREFIX_BYTES = 1024 * 1024
_COMMA, _QUOTE = ord(","), ord('"')
_OPEN_LIST, _CLOSE_LIST, _OPEN_OBJECT, _CLOSE_OBJECT = ord("["), ord("]"), ord("{"), ord("}")
_WHITESPACE = b" \t\r\n"  # JSON's four (RFC 8259, section 2)


def _values_at_most(body: bytes) -> int:
    """An upper bound on `_values_outside_strings(body)`, from four byte counts (a few ms for 8 MiB):
    commas and brackets inside strings, and whitespace inside an empty list, only add to it."""
    return 1 + body.count(b",") + body.count(b"[") + body.count(b"{") - body.count(b"[]") - body.count(b"{}")


def _values_outside_strings(body: bytes) -> int:
    """The number of JSON values `body` holds when it is JSON: every value but the first follows a
    comma or is the first of a non-empty list or object, so values = 1 + commas + opening brackets -
    empty lists and objects, all counted outside strings (escaped backslashes and quotes dropped
    first, so every quote left opens or closes a string). When `body` is not JSON it bounds what a
    parser builds before the error: up to there the body is a prefix of JSON. Vectorised with numpy:
    no Python object per value, whatever the body holds."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(unescaped, np.uint8)
    quote = text == _QUOTE
    # Parity of the quotes so far (uint8 wraps, parity kept): a string's closing quote stays, in place of
    # the string, so `["x"]` does not read as an empty list.
    outside = (np.cumsum(quote, dtype=np.uint8) & 1) == 0
    bare = np.frombuffer(text[outside].tobytes().translate(None, _WHITESPACE), np.uint8)
    before, after = bare[:-1], bare[1:]
    empties = np.count_nonzero(((before == _OPEN_LIST) & (after == _CLOSE_LIST))
                               | ((before == _OPEN_OBJECT) & (after == _CLOSE_OBJECT)))
    opens = np.count_nonzero(bare == _OPEN_LIST) + np.count_nonzero(bare == _OPEN_OBJECT)
    return 1 + int(np.count_nonzero(bare == _COMMA)) + int(opens) - int(empties)


def count_json_values(body: bytes, limit: int) -> int:
    """How many JSON values `body` holds (every scalar, list and object counts one; a key does not),
    as far as `limit` needs: at most `limit` when it holds at most `limit` (a parser then builds at
    most `limit` values from it, JSON or not), else more than `limit` and at most the count (which
    may stop at the body's first PREFIX_BYTES). Runs in the helper process; nothing is parsed."""
    bound = _values_at_most(body)
    if bound <= limit:
        return bound
    if len(body) > PREFIX_BYTES:
        # A prefix's count less one (its last `[` may be an empty list's) is at most the body's.
        prefix_count = _values_outside_strings(body[:PREFIX_BYTES]) - 1
        if prefix_count > limit:
            return prefix_count
    return _values_outside_strings(body)


# prctl(2)'s option that has the kernel signal a process when the thread that made it ends: the
# helper is made by the event loop's thread (`start`, `check`), which lives as long as the gateway.
PR_SET_PDEATHSIG = 1


def _start_helper(gateway_pid: int) -> None:
    """The helper process's first step. Niced: on a busy host the event loop's process, not the
    counting, gets the CPU first. On Linux the kernel kills it when the gateway dies, even by
    SIGKILL: its queue's pipes stay open in the helper itself, so without this it (and
    multiprocessing's resource tracker behind it) would outlive the gateway, orphaned."""
    os.nice(10)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != gateway_pid:  # the gateway died before prctl took effect
        os._exit(0)


class JsonCounter:
    """Refuses, off the event loop, a JSON body of more than `max_values` values (`check`). One
    helper process (spawned, so it shares nothing with the loop's threads), started by `start`;
    bodies queue for it, so a flood of large bodies slows large bodies only."""

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the helper process in the background (a spawned interpreter takes a second or
        more to start), so the first large body does not wait for all of it."""
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_helper, initargs=(os.getpid(),))
        self._pool.submit(count_json_values, b"[]", self.max_values)

    def stop(self) -> None:
        """Stop the helper process without waiting for it (a broken pool: the next body starts another)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def aclose(self) -> None:
        """Stop the helper process at the gateway's shutdown: kill it (a count under way is of no
        use to anyone now, and an 8 MiB body takes seconds), then wait, in a thread, until the
        pool's manager thread has seen it die and ended. Left running past shutdown(wait=False),
        that thread closes its wake-up pipe while the interpreter's exit hook
        (concurrent.futures.process._python_exit) may still write to it: on CPython 3.11 an
        unlocked check, so now and then the exit logged "OSError: [Errno 9] Bad file descriptor"
        (CPython gh-125451 put the pipe under a lock in 3.12)."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        # The pool's own processes: ProcessPoolExecutor has no public way to stop a busy worker
        # before Python 3.14's kill_workers().
        for process in list((pool._processes or {}).values()):  # a copy: the manager thread edits it
            process.kill()
        await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    async def check(self, body: bytes, where: str = "body") -> None:
        """Raise PayloadTooLargeError (413) when the JSON `body` holds more than `max_values` values;
        UnavailableError (503) when the helper process died (it is restarted for the next body)."""
        if len(body) <= INLINE_BYTES:
            return
        if self._pool is None:
            self.start()
        assert self._pool is not None
        try:
            count = await asyncio.get_running_loop().run_in_executor(self._pool, count_json_values, body,
                                                                     self.max_values)
        except BrokenProcessPool as exc:  # killed (out of memory?): a new one for the next body
            log.error("the JSON counting process died; restarting it", extra={"error": repr(exc)})
            self.stop()
            raise UnavailableError("the gateway could not check this body's size; retry") from exc
        if count > self.max_values:
            raise PayloadTooLargeError(f"{where} holds at least {count} JSON values, more than the {self.max_values} "
                                       f"one request may hold (VRAMGUARD_MAX_JSON_VALUES)")
