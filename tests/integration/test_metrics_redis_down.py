"""/metrics, the status JSON and readiness while Redis is down: answers, not hangs or stale
numbers (the failure path of a scrape), with a private real redis-server that the test stops."""

from __future__ import annotations

import httpx

from tests.helpers import RedisServer, wait_until
from tests.integration.test_metrics import scrape, value
from vramguard.gateway.app import create_app


async def test_a_scrape_while_redis_is_down_says_so(settings_factory) -> None:
    """1. A gateway runs on its own Redis; a scrape shows redis_up 1 and the queue series.
    2. Redis stops.
    Result: /metrics still answers with redis_up 0 and no queue series; /status.json says
    redis_ok false; readiness is 503 naming Redis."""
    server = RedisServer()
    server.start()
    try:
        app = create_app(settings_factory(redis_url=server.url, served_models="synthetic"))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as gw:
                samples, _ = await scrape(gw)
                assert value(samples, "vramguard_redis_up") == 1
                assert value(samples, "vramguard_queue_depth", model="synthetic") == 0
                server.stop()
                samples, _ = await scrape(gw)
                assert value(samples, "vramguard_redis_up") == 0
                assert value(samples, "vramguard_queue_depth", model="synthetic") is None
                assert value(samples, "vramguard_requests_in_flight", model="synthetic") == 0
                assert (await gw.get("/status.json")).json()["redis_ok"] is False

                async def not_ready() -> bool:
                    response = await gw.get("/health/ready")
                    return response.status_code == 503 and response.json()["reasons"][0].startswith("redis:")

                await wait_until(not_ready, 15)
    finally:
        server.stop()
