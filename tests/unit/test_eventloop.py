"""shared/eventloop.py: the loop each `event_loop` setting names, as uvicorn resolves its `loop`."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from vramguard.shared import eventloop


async def running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(("choice", "module"), [("auto", "uvloop"), ("uvloop", "uvloop"),
                                                ("asyncio", "asyncio.unix_events")])
def test_run_uses_the_loop_the_setting_names(choice: eventloop.EventLoopChoice, module: str) -> None:
    assert eventloop.run(running_loop_module(), choice) == module


def test_auto_falls_back_to_asyncio_and_uvloop_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError
    assert eventloop.loop_factory("auto") is asyncio.new_event_loop
    with pytest.raises(ImportError):
        eventloop.loop_factory("uvloop")
    monkeypatch.undo()
    assert eventloop.loop_factory("auto") is uvloop.new_event_loop
