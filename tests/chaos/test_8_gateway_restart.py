"""Gateway restart: a gateway killed while its request is in a forward, and a new one started.

1. A gateway and one worker with 1.5 s forwards; reply streams live 5 s without keepalive.
2. A request is in a forward when the gateway gets SIGKILL; a new gateway starts on the port.

Result: the worker answers into the dead gateway's reply stream (never the new one's; it does
not recreate a missing stream either), acks and deletes the entry; the new gateway serves new
requests; the dead gateway's reply stream expires by itself within its TTL.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.chaos.load import record_figures
from tests.helpers import wait_until
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import ReplyMessage

TTL_S = 5


async def test_a_dead_gateways_replies_go_nowhere_else_and_expire(chaos_stack, chaos_redis) -> None:
    chaos_stack.settings.update({"reply_stream_ttl_s": TTL_S, "models__synthetic__params": '{"batch_ms": 1500}'})
    keys = Keys(chaos_stack.settings["key_prefix"])
    stream = keys.request_stream("synthetic")
    chaos_stack.start_gateway()
    chaos_stack.start_worker()
    await chaos_stack.wait_ready()
    (old_stream,) = [k async for k in chaos_redis.scan_iter(match=keys.reply_stream("*"))]
    async with httpx.AsyncClient(base_url=chaos_stack.url, timeout=10) as client:
        orphan = asyncio.ensure_future(client.post("/v1/models/synthetic/infer", json={"inputs": ["orphan"]}))

        async def in_forward() -> bool:
            return (await chaos_redis.xpending(stream, GROUP))["pending"] == 1

        await wait_until(in_forward, 10)
        chaos_stack.gateway.send_signal(signal.SIGKILL)
        chaos_stack.gateway.wait()
        killed_s = time.monotonic()
        try:
            await orphan
        except httpx.HTTPError:
            pass  # its client lost the connection with the gateway; nobody else may get its answer

    async def orphan_answered() -> bool:
        return await chaos_redis.xlen(stream) == 0

    # Read before a new gateway starts: the dead one's stream expires TTL_S after its last write,
    # and a slow start could outlast that.
    await wait_until(orphan_answered, 5)
    old = [r.outputs for _id, f in await chaos_redis.xrange(old_stream) for r in ReplyMessage.from_entry(f)]
    assert old == [["orphan"]]  # answered into the dead gateway's stream only
    chaos_stack.start_gateway()
    await chaos_stack.wait_ready()
    async with httpx.AsyncClient(base_url=chaos_stack.url, timeout=10) as client:
        fresh = await client.post("/v1/models/synthetic/infer", json={"inputs": ["fresh"]})
    assert fresh.status_code == 200 and fresh.json()["outputs"] == ["fresh"]
    streams = {k async for k in chaos_redis.scan_iter(match=keys.reply_stream("*"))}
    (new_stream,) = streams - {old_stream}
    new = [r.outputs for _id, f in await chaos_redis.xrange(new_stream) for r in ReplyMessage.from_entry(f)]
    assert ["orphan"] not in new

    async def expired() -> bool:
        return not await chaos_redis.exists(old_stream)

    await wait_until(expired, TTL_S + 2)
    record_figures(f"[chaos] 8 gateway restart: orphan reply in the dead gateway's stream only; that stream "
                   f"expired {time.monotonic() - killed_s:.1f} s after the kill (TTL {TTL_S} s)")
