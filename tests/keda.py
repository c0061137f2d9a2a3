"""What KEDA's `redis-streams` scaler reads for a trigger of deploy/k8s/base/scaledobject.yaml, as
its source decides it (kedacore/keda, pkg/scalers/redis_streams_scaler.go: parseRedisStreamsMetadata
and createEntriesCountFn): with a consumerGroup, the group's lag (lagCount given; XINFO GROUPS, a
NULL lag read as 0) or its pending entries (XPENDING summary count); without one, the stream's
length (XLEN). The desired replica count is the figure over the trigger's target, rounded up."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from redis.asyncio.client import Pipeline

SCALED_OBJECT = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base" / "scaledobject.yaml"


def stream_triggers(docs: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """The metadata of every redis-streams trigger of the ScaledObject in `docs` (default: the base's file)."""
    if docs is None:
        docs = [d for d in yaml.safe_load_all(SCALED_OBJECT.read_text()) if d]
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    return [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "redis-streams"]


def figure_kind(meta: dict[str, str]) -> str:
    """"lag", "pending" or "length": which figure KEDA reads for a trigger with this metadata."""
    if "consumerGroup" in meta:
        return "lag" if "lagCount" in meta else "pending"
    return "length"


def target(meta: dict[str, str]) -> int:
    """The trigger's target value per replica (KEDA's default 5 where none is given)."""
    key = {"lag": "lagCount", "pending": "pendingEntriesCount", "length": "streamLength"}[figure_kind(meta)]
    return int(meta.get(key, 5))


def queue_figure(pipe: Pipeline, meta: dict[str, str], stream: str) -> None:
    """Queue on `pipe` the command KEDA sends for the trigger `meta` on `stream`; `figure` reads its reply."""
    kind = figure_kind(meta)
    if kind == "length":
        pipe.xlen(stream)
    elif kind == "pending":
        pipe.xpending(stream, meta["consumerGroup"])
    else:
        pipe.xinfo_groups(stream)


def figure(meta: dict[str, str], reply: Any) -> int:
    """The figure KEDA takes from the reply to the command `queue_figure` queued for `meta`."""
    kind = figure_kind(meta)
    if kind == "length":
        return int(reply)
    if kind == "pending":
        return int(reply["pending"])
    group = meta["consumerGroup"]
    info = next(i for i in reply if i["name"] in (group, group.encode()))
    return int(info.get("lag") or 0)  # go-redis leaves a NULL lag at 0


def desired_replicas(figure: int, meta: dict[str, str]) -> int:
    return math.ceil(figure / target(meta))
