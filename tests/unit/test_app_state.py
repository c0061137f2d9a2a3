"""gateway/protocols/native.py's AppState: app.state as Starlette's State, with values as plain attributes."""

from __future__ import annotations

import pytest

from vramguard.gateway.protocols.native import AppState, GatewayApp


def test_the_gateway_app_reads_its_state_as_starlette_does() -> None:
    state = GatewayApp().state
    assert isinstance(state, AppState)
    state.settings = "s"
    state["dispatcher"] = "d"
    assert (state.settings, state["settings"], state.dispatcher, state["dispatcher"]) == ("s", "s", "d", "d")
    assert sorted(state) == ["dispatcher", "settings"] and len(state) == 2
    state.settings = "t"  # a value replaced is replaced for both ways of reading it
    assert state.settings == state["settings"] == "t"


def test_a_deleted_value_is_gone_both_ways() -> None:
    state = AppState()
    state.x = 1
    del state.x
    state["y"] = 2
    del state["y"]
    assert not hasattr(state, "x") and not hasattr(state, "y") and list(state) == []
    with pytest.raises(KeyError):
        state["x"]
