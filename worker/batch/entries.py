"""What a request stream's entries hold, as a worker reads them: `Entry`, one request (or why it
could not be decoded), and packs, entries that carry several requests (the admissions of one
gateway call share an entry, gateway/admission/dispatch.py ADMISSION; field REQUESTS_FIELD, shared/protocol.py).

At the read, `read_entries` turns a pack into one `Entry` per request, each with an entry id of its
own, `<stream id>#<index>`, so batching, triage, deadlines and replies treat its requests as any
others. Such a part id never reaches Redis: `PackLedger.settle` turns answered ids into the stream
ids to XACK + XDEL, a pack's only with its last request. A consumer group delivers a whole entry to
one consumer, so the ledger of the worker that read a pack counts all of it; a worker that dies
leaves the pack pending, and reclaim splits it into entries of one request each before anything
runs it again (worker/batch/reclaim.py), so no count ever has to outlive a process.
Never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vramguard.shared.protocol import (
    ENTRY_FIELD,
    PRIOR_DELIVERIES_FIELD,
    REQUESTS_FIELD,
    EntryId,
    ProtocolError,
    RequestMessage,
    split_requests,
)

PART_SEP = "#"


@dataclass(slots=True)
class Entry:
    """One stream entry as read: a decoded request, or the reason it could not be decoded. Not
    changed after the read (not frozen only because a frozen dataclass's __init__ costs about three
    times as much, and the worker builds one per request).
    `delivery_count`: how often its request has been delivered, this time included (the consumer
    group's count plus a split pack's, `decode_entry`); above 1, a worker that held it died: it
    is a suspect, served alone (worker/batch/reclaim.py)."""

    entry_id: EntryId
    message: RequestMessage | None
    fields: dict[bytes, bytes]
    decode_error: str | None = None
    delivery_count: int = 1
    # Its request's items (0 when undecodable): a field, not a property, since the batcher sums it
    # over every held entry at each read of the batch window.
    n_items: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_items = len(self.message.inputs) if self.message is not None else 0


def decode_entry(entry_id: bytes, fields: dict[bytes, bytes], delivery_count: int = 1) -> Entry:
    """An entry as delivered the `delivery_count`-th time (XREADGROUP ">": the first), plus the
    deliveries of the pack it was split from (`prior_deliveries`). Never raises: a malformed
    entry comes back with `decode_error` set (it goes to the dead letter)."""
    eid = EntryId(entry_id.decode())
    deliveries = delivery_count + prior_deliveries(fields)
    data = fields.get(ENTRY_FIELD)
    if data is None:
        return Entry(eid, None, fields, f"entry has no {ENTRY_FIELD.decode()!r} field", deliveries)
    return _decoded(eid, data, fields, deliveries)


def _decoded(eid: EntryId, data: bytes, fields: dict[bytes, bytes] | None = None, deliveries: int = 1) -> Entry:
    """The Entry of the packed request `data` (its entry's `fields`: {ENTRY_FIELD: data} when None)."""
    fields = {ENTRY_FIELD: data} if fields is None else fields
    try:
        return Entry(eid, RequestMessage.decode(data), fields, None, deliveries)
    except ProtocolError as exc:
        return Entry(eid, None, fields, str(exc), deliveries)


def prior_deliveries(fields: Mapping[bytes, bytes]) -> int:
    """The deliveries of the pack an entry was split from (PRIOR_DELIVERIES_FIELD, written by
    worker/batch/reclaim.py), 0 for any other entry or a value that is not a small count."""
    raw = fields.get(PRIOR_DELIVERIES_FIELD, b"0")
    return int(raw) if raw.isdigit() and len(raw) < 6 else 0


def part_id(stream_id: str, index: int) -> EntryId:
    """The entry id of request `index` (0-based) of the pack at `stream_id`."""
    return EntryId(f"{stream_id}{PART_SEP}{index}")


def stream_id_of(entry_id: str) -> EntryId:
    """The stream entry that holds `entry_id`: itself, or a part's pack."""
    return EntryId(entry_id.partition(PART_SEP)[0])


def stream_ids(entry_ids: Iterable[str]) -> list[EntryId]:
    """The stream entries holding `entry_ids`, each once, in first-seen order (for commands that
    take stream ids: XPENDING, XCLAIM)."""
    return list(dict.fromkeys(stream_id_of(e) for e in entry_ids))


def pack_parts(fields: Mapping[bytes, bytes]) -> list[bytes] | None:
    """The packed requests of a pack's fields, or None when the entry is not a pack. Raises
    ProtocolError for a pack whose value is not a list of packed requests."""
    data = fields.get(REQUESTS_FIELD)
    if data is None or ENTRY_FIELD in fields:
        return None
    return split_requests(data)


class PackLedger:
    """The packs one worker has read and not fully answered: by stream id, the indexes of their
    requests not answered yet. Lives as long as the worker process (see the module docstring)."""

    def __init__(self) -> None:
        # stream id -> (requests the pack carries, indexes of those not answered yet)
        self._open: dict[EntryId, tuple[int, set[int]]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def read_entries(self, entry_id: bytes, fields: dict[bytes, bytes]) -> list[Entry]:
        """One Entry per request of a stream entry as read: a plain entry as `decode_entry` gives
        it, a pack's requests as parts (each decoded alone: a malformed one fails only itself),
        registered here. A pack whose list itself is malformed comes back as one undecodable
        Entry under its stream id (it goes to the dead letter whole). Never raises."""
        try:
            parts = pack_parts(fields)
        except ProtocolError as exc:
            return [Entry(EntryId(entry_id.decode()), None, fields, str(exc))]
        if parts is None:
            return [decode_entry(entry_id, fields)]
        stream_id = EntryId(entry_id.decode())
        self._open[stream_id] = (len(parts), set(range(len(parts))))
        # Each part as the entry of its own it would be (the fields a dead letter of it keeps), as
        # decode_entry reads a plain entry, first delivered (a pack's parts are never redelivered:
        # reclaim splits the pack first). Inline: this runs once per request the worker serves.
        return [_decoded(part_id(stream_id, i), data) for i, data in enumerate(parts)]

    def settle(self, entry_ids: Iterable[EntryId]) -> list[tuple[EntryId, int]]:
        """Mark `entry_ids` answered. Returns the stream entries now done (plain entries, and
        packs whose last request is among them), each with the requests it carried, for the XACK
        + XDEL and the queued-requests counter (worker/batch/publish.py). A part already settled, or of
        a pack this ledger does not know (answered before a restart), settles nothing."""
        done: list[tuple[EntryId, int]] = []
        for entry_id in dict.fromkeys(entry_ids):
            stream_id, sep, index = entry_id.partition(PART_SEP)
            if not sep:
                done.append((entry_id, 1))
                continue
            pack = self._open.get(EntryId(stream_id))
            if pack is None or int(index) not in pack[1]:
                continue
            pack[1].discard(int(index))
            if not pack[1]:
                del self._open[EntryId(stream_id)]
                done.append((EntryId(stream_id), pack[0]))
        return done

    def is_open(self, entry_id: EntryId) -> bool:
        """Whether `entry_id` still awaits its answer: a plain entry always (this ledger does not
        track them), a part until it is settled."""
        stream_id, sep, index = entry_id.partition(PART_SEP)
        if not sep:
            return True
        pack = self._open.get(EntryId(stream_id))
        return pack is not None and int(index) in pack[1]

