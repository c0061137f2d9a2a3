"""A worker told to stop serves what it already read, including entries carried over past a full
batch, before it exits 0: nothing it read is left pending for a reclaim."""

from __future__ import annotations

from tests.helpers import wait_until
from vramguard.shared.clock import now_ms
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.protocol import ENTRY_FIELD, ReplyMessage, RequestId, RequestMessage
from vramguard.worker.runner import ExitCode


async def test_drain_serves_the_carried_over_entries(redis_client, start_worker, key_prefix) -> None:
    keys = Keys(key_prefix)
    stream, reply_to = keys.request_stream("synthetic"), keys.reply_stream("test")
    await redis_client.xadd(reply_to, {b"init": b"1"})
    # One request per entry: a read then asks for as many entries as the batch has room for items
    # (4), not for two packs' worth, and so takes more items than one batch holds.
    handle = await start_worker(models={"synthetic": {"max_batch_size": 4, "max_requests_per_entry": 1,
                                                      "params": {"batch_ms": 500}}})
    async with redis_client.pipeline(transaction=True) as pipe:  # one MULTI: the worker reads all 4 at once
        for i in range(4):  # 3 inputs each: a read of 4 entries keeps one, carries three over
            msg = RequestMessage(RequestId(f"r{i}"), "synthetic", [i] * 3, reply_to, now_ms() + 30_000, now_ms())
            pipe.xadd(stream, {ENTRY_FIELD: msg.encode()})
        await pipe.execute()
    await wait_until(lambda: len(handle.worker.held_entries()) == 4, 5)  # 1 running + 3 carried
    assert await handle.stop() == ExitCode.OK
    entries = await redis_client.xrange(reply_to)
    replies = [r for _id, f in entries for r in ReplyMessage.from_entry(f)]
    assert sorted(r.request_id for r in replies) == ["r0", "r1", "r2", "r3"] and all(r.ok for r in replies)
    assert (await redis_client.xpending(stream, GROUP))["pending"] == 0
