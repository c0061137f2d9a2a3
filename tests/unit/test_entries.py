"""worker/batch/entries.py: a pack (several requests in one stream entry) read as one Entry per request,
acked with its last request and counted in requests; shared/protocol.py's request list format."""

from __future__ import annotations

import msgpack
import pytest

from vramguard.shared.protocol import (
    ENTRY_FIELD,
    PRIOR_DELIVERIES_FIELD,
    REQUESTS_FIELD,
    EntryId,
    ProtocolError,
    RequestId,
    RequestMessage,
    pack_requests,
    split_requests,
)
from vramguard.worker.batch.entries import PackLedger, decode_entry, stream_id_of, stream_ids


def request(tag: str) -> bytes:
    return RequestMessage(RequestId(tag), "synthetic", [1], "rep", 2_000, 1_000).encode()


def test_a_request_list_written_by_lua_or_python_reads_back_as_bytes() -> None:
    # Lua's cmsgpack writes strings as msgpack str, Python as bin: both come back as the bytes.
    as_str = msgpack.packb([b"\xff\x00a", b"b"], use_bin_type=False)
    assert split_requests(as_str) == [b"\xff\x00a", b"b"]
    assert split_requests(pack_requests([b"x", b"y"])) == [b"x", b"y"]
    for bad in (b"\xc1", msgpack.packb([]), msgpack.packb([1, 2]), msgpack.packb({"a": 1}), b""):
        with pytest.raises(ProtocolError):
            split_requests(bad)


def test_a_pack_is_read_as_one_entry_per_request_and_a_plain_entry_as_itself() -> None:
    ledger = PackLedger()
    parts = ledger.read_entries(b"7-1", {REQUESTS_FIELD: pack_requests([request("a"), b"garbage", request("c")])})
    assert [p.entry_id for p in parts] == ["7-1#0", "7-1#1", "7-1#2"]
    assert [p.message.request_id if p.message else None for p in parts] == ["a", None, "c"]
    assert parts[1].decode_error and parts[1].fields == {ENTRY_FIELD: b"garbage"}  # what its dead letter keeps
    assert all(p.delivery_count == 1 for p in parts)
    (plain,) = ledger.read_entries(b"8-0", {ENTRY_FIELD: request("d")})
    assert plain.entry_id == "8-0" and plain.message is not None and len(ledger) == 1
    (broken,) = ledger.read_entries(b"9-0", {REQUESTS_FIELD: b"\xc1"})
    assert broken.entry_id == "9-0" and broken.message is None and "malformed" in (broken.decode_error or "")


def test_a_pack_is_acked_with_its_last_request_and_counts_all_of_them() -> None:
    ledger = PackLedger()
    ledger.read_entries(b"7-1", {REQUESTS_FIELD: pack_requests([request("a"), request("b"), request("c")])})
    assert ledger.settle([EntryId("7-1#1")]) == []
    assert ledger.settle([EntryId("7-1#1"), EntryId("7-1#0")]) == []  # a part settled twice counts once
    assert not ledger.is_open(EntryId("7-1#0")) and ledger.is_open(EntryId("7-1#2"))
    assert ledger.settle([EntryId("7-1#2"), EntryId("8-0")]) == [("7-1", 3), ("8-0", 1)]
    assert len(ledger) == 0 and not ledger.is_open(EntryId("7-1#2"))
    assert ledger.settle([EntryId("7-1#2")]) == []  # already acked: nothing twice


def test_split_requests_carry_their_packs_deliveries() -> None:
    entry = decode_entry(b"9-0", {ENTRY_FIELD: request("a"), PRIOR_DELIVERIES_FIELD: b"2"})
    assert entry.delivery_count == 3 and entry.message is not None
    assert decode_entry(b"9-0", {ENTRY_FIELD: request("a")}, delivery_count=2).delivery_count == 2
    for odd in (b"-1", b"x", b"9999999"):  # not a small count: read as none
        assert decode_entry(b"9-0", {ENTRY_FIELD: request("a"), PRIOR_DELIVERIES_FIELD: odd}).delivery_count == 1


def test_part_ids_map_to_their_stream_entry() -> None:
    assert stream_id_of("7-1#3") == "7-1" and stream_id_of("7-1") == "7-1"
    assert stream_ids(["7-1#0", "8-0", "7-1#2"]) == ["7-1", "8-0"]
