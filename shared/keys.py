"""Every Redis key and the consumer group name, in one place (docs/concepts/architecture.md "The pieces").

    <prefix>:req:{<model>}        request stream, consumer group `workers`
    <prefix>:rep:{<gateway_id>}   reply stream of one gateway process
    <prefix>:dlq:{<model>}        dead-letter stream
    <prefix>:queued:{<model>}     requests queued or in flight (an entry of the stream may carry several)
    <prefix>:hb:{<worker_id>}     heartbeat hash (with a TTL)
    <prefix>:alive:{<worker_id>}  the liveness probe's write test, when a heartbeat is stale (1 s TTL)
    <prefix>:workers:{<model>}    sorted set worker_id -> last heartbeat (epoch ms, shared clock)
    <prefix>:adm:{<model>}:<call_id>      admission record: one admission call's answer, for a re-sent call (short TTL)
    <prefix>:claim:{<model>}:<worker_id>  a worker's last claim, for a re-sent claim (short TTL)
    <prefix>:runs:{<model>}:<entry_id>    how often a request split from a pack ran alone (hash; expires)
    <prefix>:placement            a `vramguard up` stack's placed worker processes and their last exits (hash)
    <prefix>:startfail:{<model>}  hash worker_id -> why its last start failed (JSON; expires)
    <prefix>:gen:{<model>}:<request_id>     a generating sequence's progress (hash: its tokens so far, last chunk)
    <prefix>:cancel:{<model>}:<request_id>  set by a gateway whose client left: the worker stops the sequence
    <prefix>:tok:{<model>}        a generative model's tokenizer and chat template, for the gateway's prompt count
    <prefix>:exec:{<model>}       test-only (fault injection): hash of executions, "<request_id> <pid>-<n>"

The braces are Redis Cluster hash tags: only the part inside them picks the hash slot, so all of
one model's keys share a slot (the dead-letter MULTI touches its request and dead-letter streams
together) while different models and gateways spread over the primaries. No script or MULTI
touches a model's keys and a gateway's or worker's keys together (docs/guides/redis.md, "Cluster").
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder bound to one `prefix` (Settings.key_prefix), so tests can isolate themselves."""

    prefix: str = "vramguard"

    def request_stream(self, model: str) -> str:
        return f"{self.prefix}:req:{{{model}}}"

    def reply_stream(self, gateway_id: str) -> str:
        return f"{self.prefix}:rep:{{{gateway_id}}}"

    def dead_letter_stream(self, model: str) -> str:
        return f"{self.prefix}:dlq:{{{model}}}"

    def queued_requests(self, model: str) -> str:
        """Requests queued or in flight for `model`: raised by the admission script
        (gateway/admission/dispatch.py), lowered with each XDEL of its request stream (worker/batch/publish.py)."""
        return f"{self.prefix}:queued:{{{model}}}"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}:hb:{{{worker_id}}}"

    def worker_index(self, model: str) -> str:
        return f"{self.prefix}:workers:{{{model}}}"

    def admissions(self, model: str) -> str:
        """The records of the model's recent admission calls (gateway/admission/dispatch.py ADMISSION), a
        hash of call id -> answer, kept for a re-sent call to find; on the model's slot, as the calls'
        request stream. One key that always exists, not one per call: during a Redis Cluster slot
        migration a script naming a key that does not exist is refused (TRYAGAIN)."""
        return f"{self.prefix}:adm:{{{model}}}"

    def claim_record(self, model: str, worker_id: str) -> str:
        return f"{self.prefix}:claim:{{{model}}}:{worker_id}"

    def suspect_runs(self, model: str, entry_id: str) -> str:
        """How often the request of `entry_id`, split from a pack whose worker died, has started
        to run alone (worker/batch/reclaim.py RUN_ALONE); on the model's slot."""
        return f"{self.prefix}:runs:{{{model}}}:{entry_id}"

    def placement(self) -> str:
        """worker_id -> JSON {model, program, device, exit?, reason?, exited_ms?}, written by the launcher
        (vramguard/cli/placed.py) and read by the status page."""
        return f"{self.prefix}:placement"

    def start_failures(self, model: str) -> str:
        return f"{self.prefix}:startfail:{{{model}}}"

    def generation_progress(self, model: str, request_id: str) -> str:
        return f"{self.prefix}:gen:{{{model}}}:{request_id}"

    def tokenizer(self, model: str) -> str:
        return f"{self.prefix}:tok:{{{model}}}"

    def cancel(self, model: str, request_id: str) -> str:
        return f"{self.prefix}:cancel:{{{model}}}:{request_id}"

    def executions(self, model: str) -> str:
        return f"{self.prefix}:exec:{{{model}}}"


def hash_tag(key: str) -> str:
    """The part of `key` Redis Cluster hashes: the text inside the first {...}, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start != -1 and end > start + 1 else key
