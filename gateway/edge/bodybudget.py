"""The request body bytes one gateway process holds at once. Each body is held from its first byte
until its response is sent (the body, its parsed inputs and the packed request live that long), so
1,000 connections x an 8 MiB body cannot take the process past its memory: past
`Settings.max_inflight_body_bytes` a request gets 503 `unavailable` (Retry-After: 1), a reason
naming the bound, before more of its body is read. A pure ASGI middleware (`HoldBodies`) owns the
per-request hold; gateway/edge/checks.py's read_body takes from it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from vramguard.shared.errors import UnavailableError

STATE_KEY = "body_hold"  # request.state.body_hold: the request's BodyHold


class BodyBudget:
    """`held_bytes` of request bodies in this process against `limit_bytes`."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0


class BodyHold:
    """One request's share of a BodyBudget: `take` as the body arrives, `release` once answered."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def take(self, n_bytes: int) -> None:
        """Hold `n_bytes` more. Raises UnavailableError (503) when the process would hold more than
        its bound; then nothing more is held for this request."""
        budget = self._budget
        if n_bytes > 0 and budget.held_bytes + n_bytes > budget.limit_bytes:
            raise UnavailableError(
                f"this gateway holds {budget.held_bytes} bytes of request bodies, its bound is {budget.limit_bytes} "
                f"(VRAMGUARD_MAX_INFLIGHT_BODY_BYTES); retry, or send it to another gateway")
        budget.held_bytes += n_bytes
        self.bytes += n_bytes

    def release(self) -> None:
        self._budget.held_bytes -= self.bytes
        self.bytes = 0


class HoldBodies:
    """ASGI middleware: gives each HTTP request a BodyHold (`scope["state"]["body_hold"]`) and
    releases it when the request's handling ends, whatever the outcome."""

    def __init__(self, app: ASGIApp, budget: BodyBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hold = BodyHold(self.budget)
        scope.setdefault("state", {})[STATE_KEY] = hold
        try:
            await self.app(scope, receive, send)
        finally:
            hold.release()
