"""What the operator reads from a ScaledObject CR's body beside the reader (`manifests.scaledobject`): its scale
target as written (the one-ScaledObject-per-workload rule), its timestamps, the ways a record pauses, and a kopf
body as a plain dict. Pure."""

from __future__ import annotations

import datetime
from typing import Any

import msgspec

from warmpool import protocol

__all__ = ["one_way_pause", "parse_time", "plain", "scale_target"]


def parse_time(text: Any) -> float | None:
    """An RFC 3339 timestamp (``creationTimestamp``) as Unix seconds; None when it is not one."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def scale_target(body: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the scale target as written (the validator checks it; this is for the conflict rule)."""
    ref = (body.get("spec") or {}).get("scaleTargetRef") or {}
    name = ref.get("name")
    if not isinstance(name, str) or not name:
        return None
    kind = ref.get("kind") or "Deployment"
    return (str(kind), name)


def one_way_pause(record: protocol.ScalerRecord) -> str:
    """The ways `record` is paused one way (``scale-in``, ``scale-out``), comma-separated; "" for none."""
    ways = (("scale-in", record.paused_scale_in), ("scale-out", record.paused_scale_out))
    return ", ".join(way for way, on in ways if on)


def plain(body: Any) -> dict[str, Any]:
    """A kopf Body (a read-only view) as a plain dict."""
    return msgspec.json.decode(msgspec.json.encode(dict(body)))  # type: ignore[no-any-return]
