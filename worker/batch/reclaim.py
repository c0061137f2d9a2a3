"""Side path of hop 3: `Reclaimer` turns the pending entries of dead workers into a retry or a
dead letter, and keeps the entries this worker holds from looking dead.

Redis does the bookkeeping (https://redis.io/docs/latest/develop/data-types/streams/):
- an entry read with XREADGROUP stays in the group's pending entries list (PEL) until XACK;
  XPENDING reports, per entry, its consumer, idle time and `delivery_count`;
- XAUTOCLAIM hands entries idle for at least `min-idle-time` to another consumer, following a
  cursor, and increments their delivery_count; XCLAIM ... JUSTID resets the idle time without
  incrementing it (https://redis.io/docs/latest/commands/xautoclaim/, .../xclaim/).

So an entry whose delivery_count is above 1 was held by a worker that died (or that restarted
under the same name). It is a *suspect*: it may be the input that killed that worker. Suspects are
claimed and served one at a time, alone, with no other batch in flight, so a poison input kills
at most itself; innocent entries of its batch are not re-delivered with it. Past
`max_deliveries` a suspect goes to the model's dead-letter stream, atomically with its ack and
an error reply to its caller (publish.py). A suspect that is a pack, several requests in one
entry, is split into entries of one request each instead of being served (_SPLIT below).
Never imports torch.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from vramguard.shared.errors import ModelError
from vramguard.shared.keys import GROUP, Keys
from vramguard.shared.periodic import Periodic
from vramguard.shared.protocol import ENTRY_FIELD, PRIOR_DELIVERIES_FIELD, EntryId, ProtocolError, ReplyMessage
from vramguard.shared.redis_client import RETRY_WINDOW_S
from vramguard.shared.settings import Settings
from vramguard.worker.batch.entries import Entry, PackLedger, decode_entry, pack_parts, prior_deliveries
from vramguard.worker.batch.publish import DeadLetter, Outgoing, publish_replies

log = logging.getLogger(__name__)

# Reset the idle time of the entries this consumer still owns, and only those: an entry another
# worker has claimed meanwhile (after a long outage) must not be taken back. Atomic in a script.
_REFRESH = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

# One claim, safe to re-send (redis-py re-sends a command whose reply was lost, and a claim run
# twice would raise an innocent entry's delivery_count twice, so it reaches the dead letter
# early). KEYS: request stream, this worker's claim record. ARGV: group, consumer, claim token
# (fresh per claim), mode, entry id ("own") or min idle ms ("auto"), cursor, record TTL ms.
# - "own": XCLAIM ARGV[5] (delivery_count + 1) only if this consumer still owns it;
# - "auto": XAUTOCLAIM COUNT 1 from the cursor (delivery_count + 1).
# The record "<token> <cursor> <entry id>" makes a re-sent claim with the same token answer the
# first run instead of claiming again; if another worker took the entry meanwhile (a reply lost
# for longer than claim_idle_ms), it is no longer ours and nothing is returned.
# Returns {cursor, entry id or '', delivery_count, fields}.
_CLAIM = """
local cursor, id = '0-0', ''
local rec = redis.call('GET', KEYS[2])
local head = ARGV[3] .. ' '
if rec and string.sub(rec, 1, #head) == head then
  local rest = string.sub(rec, #head + 1)
  local sp = string.find(rest, ' ', 1, true)
  cursor, id = string.sub(rest, 1, sp - 1), string.sub(rest, sp + 1)
else
  if ARGV[4] == 'own' then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[5], ARGV[5], 1)
    if #p == 1 and p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[5])
      id = ARGV[5]
    end
  else
    local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[5], ARGV[6], 'COUNT', 1)
    cursor = r[1]
    if r[2][1] then id = r[2][1][1] end
  end
  redis.call('SET', KEYS[2], head .. cursor .. ' ' .. id, 'PX', ARGV[7])
end
local p = {}
if id ~= '' then p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) end
-- Gone, or taken by another worker while our reply was lost (it idled past claim_idle_ms).
if #p == 0 or p[1][2] ~= ARGV[2] then return {cursor, '', 0, {}} end
local count = p[1][4]
local e = redis.call('XRANGE', KEYS[1], id, id)
local fields = {}
if e[1] then fields = e[1][2] end
return {cursor, id, count, fields}
"""
CLAIM_RECORD_TTL_MS = int(RETRY_WINDOW_S * 1000) + 1000

# Remove consumers idle longer than ARGV[2] ms that have no pending entries (a dead worker's
# name), never ARGV[3] (ourselves). XGROUP DELCONSUMER destroys a consumer's pending entries, so
# the check and the delete must be atomic. XINFO CONSUMERS fields: name, pending, idle (6.2+).
_CLEAN_CONSUMERS = """
local removed = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['pending'] == 0 and f['idle'] > tonumber(ARGV[2]) and f['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed[#removed + 1] = f['name']
  end
end
return removed
"""

# A pack (the requests of one gateway call in one entry, worker/batch/entries.py) is never run again
# whole: a worker died holding it, and any one of its requests may be why. Claimed, it is split
# into entries of one request each, added at the stream's end, and acked and deleted, atomically
# and only while this consumer still owns it (a re-sent split finds it gone and adds nothing
# twice). They are then read and served as new entries are; one that kills its worker again is
# a suspect of its own, served alone and dead-lettered past max_deliveries, its pack's other
# requests no longer with it. The queued-requests counter is untouched: the requests are still queued.
# KEYS: request stream. ARGV: group, consumer, pack id, entry field, prior deliveries field and
# value, then each packed request.
_SPLIT = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
for i = 7, #ARGV do redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[i], ARGV[5], ARGV[6]) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return #ARGV - 6
"""

# A request split from a pack counts its deliveries as the runs that could have killed a worker:
# the pack's (its prior deliveries) and each time it started to run alone, recorded here before
# it starts. Its entry's own delivery count would also count the times a worker died holding it
# read but not running (a sibling of the pack killed it): with max_deliveries 2, an innocent
# sibling would reach the dead letter. KEYS: its run count (a hash). ARGV: a token fresh per call
# (a re-sent call answers its first run), prior deliveries, max_deliveries, TTL ms. Returns the
# number of this run, or 0 when one more run would pass max_deliveries (nothing recorded).
RUN_ALONE = """
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return n end
if tonumber(ARGV[2]) + n + 1 > tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], 'n', n + 1, 'token', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return n + 1
"""
# Long enough for a split request to wait in any queue and be claimed; it only bounds the key's life.
RUN_RECORD_TTL_MS = 3_600_000

CLEANUP_EVERY = 10  # scans between consumer clean-ups


@dataclass(frozen=True, slots=True)
class Suspect:
    """A claimed entry with the `delivery_count` Redis reports for it after the claim."""

    entry: Entry
    delivery_count: int


class Reclaimer:
    """Reclaim, refresh and clean up for consumer `worker_id` of the `workers` group on `stream`.

    Every `reclaim_interval_ms` a background scan (1) resets the idle time of the entries
    `held()` returns, (2) looks for entries idle longer than `claim_idle_ms`, setting
    `has_work`, and (3) every CLEANUP_EVERY scans removes dead consumers. The serve loop then
    calls `claim_one` while `has_work` holds. At start, `load_own_pending` queues the entries
    this consumer name held in a previous life; they are claimed first, one at a time.
    """

    def __init__(
        self, settings: Settings, redis: aioredis.Redis, stream: str, dead_letter_stream: str,
        worker_id: str, held: Callable[[], Iterable[EntryId]],
    ) -> None:
        self._settings = settings
        self._redis = redis
        self._stream = stream
        self._dead_letter_stream = dead_letter_stream
        self._worker_id = worker_id
        self._held = held
        self._own: deque[EntryId] = deque()
        self._cursor = "0-0"
        self._stale_seen = False
        self._scans = 0
        self._refresh = redis.register_script(_REFRESH)
        self._clean = redis.register_script(_CLEAN_CONSUMERS)
        self._claim = redis.register_script(_CLAIM)
        self._split = redis.register_script(_SPLIT)
        self._run_alone = redis.register_script(RUN_ALONE)
        self._keys = Keys(settings.key_prefix)
        self._claim_record = Keys(settings.key_prefix).claim_record(settings.model, worker_id)
        self._queued_requests = Keys(settings.key_prefix).queued_requests(settings.model)
        self._scanner = Periodic("reclaim", self.scan, settings.reclaim_interval_ms / 1000)
        self.claimed = 0
        self.dead_lettered = 0
        self.packs_split = 0
        self.consumers_removed = 0

    def __repr__(self) -> str:
        return (f"<Reclaimer {self._worker_id} own={len(self._own)} claimed={self.claimed} "
                f"dead_lettered={self.dead_lettered} packs_split={self.packs_split} "
                f"consumers_removed={self.consumers_removed}>")

    @property
    def has_work(self) -> bool:
        """True while entries of a previous life or of dead workers may wait to be claimed."""
        return bool(self._own) or self._stale_seen

    def start(self) -> None:
        """Start the background scan (every reclaim_interval_ms)."""
        self._scanner.start()

    async def stop(self) -> None:
        """Stop the scan between two rounds (a Redis command is never cancelled mid-flight)."""
        await self._scanner.stop()

    async def load_own_pending(self) -> int:
        """Queue this consumer's pending entries (a restart under a stable name); returns how many.

        Reads XPENDING filtered by consumer. Raises RedisError.
        """
        pending = await self._redis.xpending_range(
            self._stream, GROUP, min="-", max="+", count=10_000, consumername=self._worker_id
        )
        self._own.extend(EntryId(_text(p["message_id"])) for p in pending)
        return len(self._own)

    async def scan(self) -> None:
        """One background round: refresh held entries, look for stale ones, clean consumers.
        Never raises for Redis errors (logged; the next round retries)."""
        try:
            held = sorted(self._held())
            if held:
                await self._refresh(keys=[self._stream], args=[GROUP, self._worker_id, *held])
            stale = await self._redis.xpending_range(
                self._stream, GROUP, min="-", max="+", count=1, idle=self._settings.claim_idle_ms
            )
            self._stale_seen = self._stale_seen or bool(stale)
            self._scans += 1
            if self._scans % CLEANUP_EVERY == 0:
                await self.remove_dead_consumers()
        except RedisError as exc:
            log.warning("reclaim scan failed", extra={"error": str(exc), "worker_id": self._worker_id})

    async def remove_dead_consumers(self) -> list[str]:
        """XGROUP DELCONSUMER every consumer idle over `consumer_idle_ms` with no pending entries.
        Returns their names. Raises RedisError."""
        removed = await self._clean(
            keys=[self._stream], args=[GROUP, self._settings.consumer_idle_ms, self._worker_id]
        )
        names = [_text(n) for n in removed or ()]
        if names:
            self.consumers_removed += len(names)
            log.info("removed dead consumers", extra={"consumers": names, "stream": self._stream})
        return names

    async def claim_one(self) -> Suspect | None:
        """Claim one entry: this consumer's own from a previous life first, else one idle longer
        than `claim_idle_ms` (XAUTOCLAIM COUNT 1, following the cursor). None when nothing is
        left, which clears `has_work`. Raises RedisError (nothing is lost: the entry stays pending).
        """
        while self._own:
            suspect = await self._claim_once("own", self._own[0])
            self._own.popleft()
            if suspect is not None:
                return suspect
        while self._stale_seen:
            suspect = await self._claim_once("auto", self._settings.claim_idle_ms)
            if suspect is not None:
                return suspect
            if self._cursor == "0-0":
                self._stale_seen = False  # the whole PEL was scanned; the next scan decides again
        return None

    async def _claim_once(self, mode: str, target: int | str) -> Suspect | None:
        """Run the _CLAIM script once (a fresh token, so only redis-py's own re-send of this very
        call is answered from the record); None when nothing was claimed or the entry is gone."""
        token = uuid.uuid4().hex
        cursor, raw_id, count, flat = await self._claim(
            keys=[self._stream, self._claim_record],
            args=[GROUP, self._worker_id, token, mode, target, self._cursor, CLAIM_RECORD_TTL_MS],
        )
        if mode == "auto":
            self._cursor = _text(cursor)
        if not raw_id:
            return None
        entry_id = EntryId(_text(raw_id))
        if not flat:
            # Deleted from the stream but still pending (Redis < 7 keeps it in the PEL): nothing to serve.
            await self._redis.xack(self._stream, GROUP, entry_id)
            return None
        self.claimed += 1
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        entry = decode_entry(entry_id.encode(), fields, int(count))
        try:
            parts = pack_parts(fields)
        except ProtocolError:  # served as the undecodable entry it is, which dead-letters it
            parts = None
        log.info("entry reclaimed", extra={"entry_id": entry_id, "delivery_count": entry.delivery_count,
                                           "requests": len(parts) if parts else 1, "worker_id": self._worker_id})
        if parts and not self.exhausted(entry.delivery_count):
            await self._split_pack(entry, parts)
            return None
        return Suspect(entry, entry.delivery_count)

    async def _split_pack(self, pack: Entry, parts: list[bytes]) -> None:
        """Split a claimed pack into entries of one request each (`parts`, packed), which carry
        its deliveries so far (_SPLIT). Raises RedisError (the pack stays pending, claimed by us)."""
        # The claim that found the pack counted a delivery that runs nothing: each part's first
        # read stands in for it, so the parts carry the deliveries before it.
        prior = pack.delivery_count - 1
        added = await self._split(keys=[self._stream], args=[GROUP, self._worker_id, pack.entry_id, ENTRY_FIELD,
                                                             PRIOR_DELIVERIES_FIELD, prior, *parts])
        self.packs_split += 1
        log.info("pack split for redelivery", extra={"entry_id": pack.entry_id, "requests": len(parts),
                                                     "added": int(added), "worker_id": self._worker_id})

    async def may_run(self, entry: Entry) -> bool:
        """Whether `entry`, a suspect about to run alone, may run once more: its delivery count
        within max_deliveries, or, for a request split from a pack, its pack's deliveries plus its
        runs alone so far plus this one (recorded now: _RUN_ALONE). Raises RedisError."""
        prior = prior_deliveries(entry.fields)
        if not prior:
            return not self.exhausted(entry.delivery_count)
        run = await self._run_alone(keys=[self._keys.suspect_runs(self._settings.model, entry.entry_id)],
                                    args=[uuid.uuid4().hex, prior, self._settings.max_deliveries, RUN_RECORD_TTL_MS])
        return int(run) > 0

    def exhausted(self, delivery_count: int) -> bool:
        """True when a request delivered `delivery_count` times has used up `max_deliveries` and
        must not run again."""
        return delivery_count > self._settings.max_deliveries

    async def dead_letter(self, suspect: Suspect, reply_maxlen: int) -> None:
        """Move `suspect` to the dead-letter stream, ack and delete it, and send its caller (each
        caller of a pack's requests) a model_error reply, in one MULTI (publish.py). Raises
        RedisError (it then stays pending)."""
        entry = suspect.entry
        # A request split from a pack is exhausted when its runs reached max_deliveries (may_run).
        deliveries = self._settings.max_deliveries if prior_deliveries(entry.fields) else suspect.delivery_count - 1
        reason = (f"the request was delivered {deliveries} times and each time the worker running it died; "
                  f"moved to the dead-letter stream (max_deliveries={self._settings.max_deliveries})")
        ledger = PackLedger()  # a pack's requests, so that each caller is answered and counted
        requests = ledger.read_entries(entry.entry_id.encode(), entry.fields)
        replies = [Outgoing(r.message.reply_to, ReplyMessage.failure(r.message.request_id, ModelError.code, reason,
                                                                     worker_id=self._worker_id))
                   for r in requests if r.message is not None]
        await publish_replies(
            self._redis, request_stream=self._stream, dead_letter_stream=self._dead_letter_stream,
            queued_requests=self._queued_requests, replies=replies, entry_ids=[r.entry_id for r in requests],
            dead_letters=[DeadLetter(entry.entry_id, entry.fields, reason)], reply_maxlen=reply_maxlen, ledger=ledger,
        )
        self.dead_lettered += 1
        log.error("entry dead-lettered", extra={"entry_id": entry.entry_id, "delivery_count": suspect.delivery_count,
                                                "request_id": entry.message.request_id if entry.message else None})


def _text(value: object) -> str:
    """A Redis reply value (bytes with decode_responses=False) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)
