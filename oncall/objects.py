"""What `get` and `describe` read of the ScaledObjects: the records in KV `pulse_scalers` joined with what the CRs
say in KV `pulse_objects` (`ScaledObjectView`; revision 13), and the fallback for a NATS user refused
`pulse_objects` (an on-call authorization rendered before revision 13: `objects_refused`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

import nats.js.errors
from nats.aio.client import Client

from warmpool import buckets, protocol
from warmpool.errors import BadMessage, PermissionDenied
from warmpool.protocol import ObjectStatus, ScalerRecord

__all__ = [
    "KV_TIMEOUT_S",
    "ScaledObjectView",
    "created",
    "objects_refused",
    "read_records",
    "read_scaledobjects",
]

KV_TIMEOUT_S: Final = 5.0


def created(rec: ScalerRecord) -> float:
    return rec.created_at if rec.created_at is not None else rec.updated_at


Rec = TypeVar("Rec", ScalerRecord, ObjectStatus)


async def read_records(nc: Client, bucket: str, kind: type[Rec]) -> list[Rec]:
    """Every readable record of `bucket` (`pulse_scalers`; `pulse_objects`, what the CRs say, since revision 13),
    by key; none while it does not exist (the autoscaler creates it; `pulse_scalers`: or the first apply). An
    unreadable one is skipped and said on stderr."""
    js = nc.jetstream(timeout=KV_TIMEOUT_S)
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return []
    records = []
    for key in await buckets.list_keys(js, bucket):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # deleted meanwhile
        if entry.value is None:
            continue
        try:
            records.append(protocol.decode(entry.value, kind))
        except BadMessage as err:
            print(f"warning: {bucket} {key}: unreadable record skipped ({err})", file=sys.stderr)
    return records


@dataclass(frozen=True)
class ScaledObjectView:
    """One ScaledObject as `get` and `describe` show it: its record in `pulse_scalers` (None: not published) and
    what its CR says in `pulse_objects` (`cr`; None: no operator mirrors it), at least one of them."""

    namespace: str
    name: str
    record: ScalerRecord | None
    cr: ObjectStatus | None = None

    @staticmethod
    def of(record: ScalerRecord | None, cr: ObjectStatus | None) -> ScaledObjectView:
        either = record or cr
        assert either is not None
        return ScaledObjectView(either.namespace, either.name, record, cr)

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"

    @property
    def labels(self) -> Mapping[str, str]:
        """The CR's labels where it is mirrored (what kubectl selects on, and all a CR never published has), else the
        record's. Of a CR the operator published they are the record's too: it republishes the record for a
        label-only edit as well (`manifests.conversion.same_content` compares labels)."""
        return self.cr.labels if self.cr is not None else self.record.labels if self.record is not None else {}

    @property
    def created(self) -> float:
        if self.record is not None:
            return created(self.record)
        cr = self.cr  # never published: the CR's creationTimestamp
        return 0.0 if cr is None else cr.created_at if cr.created_at is not None else cr.updated_at

    @property
    def model(self) -> str | None:
        return self.record.spec.model if self.record is not None else self.cr.model if self.cr is not None else None


async def read_scaledobjects(nc: Client, args: argparse.Namespace | None = None) -> list[ScaledObjectView]:
    """The union of `pulse_scalers` and `pulse_objects`, by namespace and name (as kubectl's -A sorts); only
    `pulse_scalers` once this user was refused `pulse_objects` (`objects_refused`, as when it does not exist)."""
    records = {r.key: r for r in await read_records(nc, protocol.SCALERS_BUCKET, ScalerRecord)}
    skip = args is not None and getattr(args, _OBJECTS_REFUSED, False)
    crs = {} if skip else {o.key: o for o in await read_records(nc, protocol.OBJECTS_BUCKET, ObjectStatus)}
    views = [ScaledObjectView.of(records.get(k), crs.get(k)) for k in records.keys() | crs.keys()]
    return sorted(views, key=lambda v: (v.namespace, v.name))


_OBJECTS_REFUSED: Final = "_objects_refused"
"""Set on the command's arguments once this NATS user was refused `pulse_objects` (`objects_refused`)."""


def objects_refused(args: argparse.Namespace) -> Callable[[PermissionDenied], bool]:
    """For `run_reads`: a refusal of `pulse_objects` is taken as that bucket missing (what the operator's CRs say
    is not shown; `pulse_scalers` is, as before revision 13), with one warning naming the fix. An on-call
    authorization rendered before revision 13 lacks the bucket's reads."""

    def take(err: PermissionDenied) -> bool:
        # $JS.API.<...>.KV_pulse_objects[.<...>], $JS.FC.KV_pulse_objects.<...>, $KV.pulse_objects.<key>
        tokens = err.subject.split(".")
        about = f"KV_{protocol.OBJECTS_BUCKET}" in tokens or tokens[:2] == ["$KV", protocol.OBJECTS_BUCKET]
        if not about or getattr(args, _OBJECTS_REFUSED, False):
            return False
        setattr(args, _OBJECTS_REFUSED, True)
        print(
            f"warning: this NATS user may not read {protocol.OBJECTS_BUCKET} (permission denied on {err.subject}), "
            f"so what the ScaledObject CRs say is not shown, only what {protocol.SCALERS_BUCKET} holds: its "
            "authorization is from before contract revision 13; render it again (`pulsescale nats "
            '--print-authorization`, README "Security") and reload nats-server',
            file=sys.stderr,
        )
        return True

    return take
