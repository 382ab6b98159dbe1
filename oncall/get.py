"""`pulsescale get`: ScaledObjects, slots and models as kubectl lists resources; what `describe` reads too.

Where each kind comes from:

- **scaledobjects** (``so``): the records in KV `pulse_scalers` (what the operator or `apply` wrote; the on-call
  NATS user may read the bucket since contract revision 5), joined with the autoscaler's ``status`` rows by
  `StatusRow.key` (by the model for an autoscaler that does not fill the key yet). The table has KEDA's
  ``kubectl get so`` columns; READY, ACTIVE and FALLBACK read ``Unknown`` when no autoscaler answers (the records
  are still listed: they are read from the bucket, not from the autoscaler).
- **slots**: the ``pool`` command's reply (the autoscaler's view: agent freshness, drains).
- **models**: the ``status`` command's rows.

``-o json|yaml`` print full objects: a ScaledObject as a manifest (apiVersion, kind, metadata, spec, status), so
``pulsescale get so NAME -o yaml | pulsescale apply -f -`` round-trips (apply reads metadata and spec and leaves
status); a list as kubectl's ``kind: List``. ``-w`` polls and prints a row when it changes; Ctrl-C ends it, exit 0.

Exit codes as the on-call verbs (`oncall.client`): 1 for a refusal or a missing object named, 3/4 when the
autoscaler does not answer a read that needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import nats.js.errors
from nats.aio.client import Client

from manifests import crdtypes, scaledobject
from oncall import jsonpath, labels
from oncall.client import EXIT_REFUSED, CommandFailed, parser, request, run_reads
from warmpool import buckets, durations, protocol
from warmpool import output as out
from warmpool.errors import BadMessage
from warmpool.protocol import PoolCommand, PoolReply, PoolSlot, ScalerRecord, StatusCommand, StatusReply, StatusRow

__all__ = [
    "ACTIVE_WITHIN_S",
    "DEFAULT_WATCH_EVERY_S",
    "KINDS",
    "KV_TIMEOUT_S",
    "Conditions",
    "created",
    "drop_none",
    "get",
    "kind_arg",
    "manifest",
    "model_rows",
    "pause_annotations",
    "read_pool",
    "read_scalers",
    "read_status",
    "row_for",
    "scaledobject_rows",
    "short_digest",
    "slot_rows",
    "tf",
]

KINDS: Final = {
    "scaledobjects": "scaledobject",
    "scaledobject": "scaledobject",
    "so": "scaledobject",
    **{short: "scaledobject" for short in crdtypes.SHORT_NAMES},  # the CRD's own short name (pso)
    crdtypes.CRD_NAME: "scaledobject",  # scaledobjects.pulsescale.io, as kubectl takes a resource.group
    "slots": "slot",
    "slot": "slot",
    "models": "model",
    "model": "model",
}
"""What `get` and `describe` accept (kubectl's plural, singular and short names, the CRD's ``pso`` and
``scaledobjects.pulsescale.io``) → the kind."""

ACTIVE_WITHIN_S: Final = crdtypes.ACTIVE_WINDOW_S
"""ACTIVE is True when demand was above the activation threshold this recently (`crdtypes.scaler_active`, the rule of
the operator's Active condition too): a few sample intervals (~300 ms each) and one status poll, so a live
trigger never flickers to False between two reads."""
DEFAULT_WATCH_EVERY_S: Final = 1.0
"""How often ``-w`` polls: a status request is cheap, and a second is as fast as a person reads rows."""
KV_TIMEOUT_S: Final = 5.0


# --- reading -------------------------------------------------------------------------------------------------------


async def read_scalers(nc: Client) -> list[ScalerRecord]:
    """Every readable record of `pulse_scalers`, by key; an unreadable one is skipped and said on stderr."""
    js = nc.jetstream(timeout=KV_TIMEOUT_S)
    try:
        kv = await js.key_value(protocol.SCALERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return []  # nothing applied yet: the autoscaler or the first apply creates it
    keys = await buckets.list_keys(js, protocol.SCALERS_BUCKET)
    records = []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # deleted meanwhile
        if entry.value is None:
            continue
        try:
            records.append(protocol.decode(entry.value, ScalerRecord))
        except BadMessage as err:
            print(f"warning: {protocol.SCALERS_BUCKET} {key}: unreadable record skipped ({err})", file=sys.stderr)
    return records


async def read_status(nc: Client, args: argparse.Namespace, *, required: bool) -> list[StatusRow] | None:
    """The autoscaler's status rows; None when none answers and they are not `required` (said on stderr)."""
    try:
        reply = await request(nc, "status", lambda **e: StatusCommand(**e), StatusReply, args)
    except CommandFailed as err:
        if required:
            raise
        if not getattr(args, "_warned", False):
            print(f"warning: status columns unknown: {err}", file=sys.stderr)
            args._warned = True
        return None
    return reply.models


async def read_pool(nc: Client, args: argparse.Namespace) -> PoolReply:
    return await request(nc, "pool", lambda **e: PoolCommand(**e), PoolReply, args)


def row_for(rec: ScalerRecord, rows: Sequence[StatusRow]) -> StatusRow | None:
    """The status row of a ScaledObject: by key, else (an autoscaler before revision 5's key) by model."""
    for r in rows:
        if r.key == rec.key:
            return r
    for r in rows:
        if r.key is None and r.model == rec.spec.model:
            return r
    return None


# --- ScaledObjects --------------------------------------------------------------------------------------------


def tf(value: bool | None) -> str:
    return "Unknown" if value is None else ("True" if value else "False")


def _active(row: StatusRow, now: float) -> bool:
    # KEDA's rule, as the CR's condition: replicas (desired > 0) are not activity.
    return crdtypes.scaler_active(row.last_active_at, now, ACTIVE_WITHIN_S)


@dataclass(frozen=True)
class Conditions:
    """KEDA's four conditions of one ScaledObject; None = Unknown (no autoscaler answered)."""

    ready: bool | None
    active: bool | None
    fallback: bool | None
    paused: bool

    @staticmethod
    def of(rec: ScalerRecord, row: StatusRow | None, status_known: bool, now: float) -> Conditions:
        paused = rec.paused or rec.paused_scale_in or rec.paused_scale_out or (row is not None and row.paused)
        if not status_known:
            return Conditions(None, None, None, paused)
        if row is None:
            return Conditions(False, False, False, paused)
        return Conditions(True, _active(row, now), row.fallback, paused)


def created(rec: ScalerRecord) -> float:
    return rec.created_at if rec.created_at is not None else rec.updated_at


def scaledobject_rows(
    records: Sequence[ScalerRecord], rows: Sequence[StatusRow] | None, now: float, *, wide: bool, namespaces: bool
) -> tuple[list[str], list[list[str]]]:
    """The table of `get so`: KEDA's columns (``kubectl get so``); wide adds MODEL, DESIRED, WARM, MODE."""
    header = ["NAME", "TARGET", "MIN", "MAX", "READY", "ACTIVE", "FALLBACK", "PAUSED", "AGE"]
    if wide:
        header += ["MODEL", "DESIRED", "WARM", "MODE"]
    if namespaces:
        header = ["NAMESPACE", *header]
    table = []
    for rec in records:
        row = row_for(rec, rows or [])
        c = Conditions.of(rec, row, rows is not None, now)
        s = rec.spec
        cells = [rec.name, f"{s.scale_target_ref.kind}/{s.scale_target_ref.name}", str(s.min_replica_count)]
        cells += [str(s.max_replica_count), tf(c.ready), tf(c.active), tf(c.fallback), tf(c.paused)]
        cells.append(durations.age(now - created(rec)))
        if wide:
            if row is not None:
                cells += [s.model, str(row.desired), str(row.warm), row.mode]
            else:
                cells += [s.model, "-", "-", "-"]
        table.append([rec.namespace, *cells] if namespaces else cells)
    return header, table


def drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value


def pause_annotations(rec: ScalerRecord) -> dict[str, str]:
    """The pause state as our annotations (KEDA's family means the same): applying them back gives the same
    record."""
    a: dict[str, str] = {}
    if rec.paused_replicas is not None:
        a[scaledobject.PAUSED_REPLICAS_ANNOTATION] = str(rec.paused_replicas)
    elif rec.paused:
        a[scaledobject.PAUSED_ANNOTATION] = "true"
    if rec.paused_scale_in:
        a[scaledobject.PAUSED_SCALE_IN_ANNOTATION] = "true"
    if rec.paused_scale_out:
        a[scaledobject.PAUSED_SCALE_OUT_ANNOTATION] = "true"
    return a


def _condition(kind: str, value: bool | None, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": tf(value), "reason": reason, "message": message}


def manifest(rec: ScalerRecord, row: StatusRow | None, status_known: bool, now: float) -> dict[str, Any]:
    """A ScaledObject as ``-o json|yaml`` prints it: apiVersion, kind, metadata, spec (camelCase, defaults
    filled in, nulls left out) and status (conditions, replica counts, last times in RFC 3339, decisions)."""
    meta: dict[str, Any] = {
        "name": rec.name,
        "namespace": rec.namespace,
        "generation": rec.generation,
        "creationTimestamp": durations.rfc3339(created(rec)),
    }
    if rec.labels:
        meta["labels"] = dict(rec.labels)
    annotations = pause_annotations(rec)
    if annotations:
        meta["annotations"] = annotations
    c = Conditions.of(rec, row, status_known, now)
    if c.ready is None:
        ready_reason, ready_message = "Unknown", "no autoscaler answered the status request"
    elif c.ready:
        ready_reason, ready_message = "AutoscalerRunsIt", "the autoscaler scales it"
    else:
        ready_reason, ready_message = "NotRunning", "the autoscaler has no row for it"
    status: dict[str, Any] = {
        "conditions": [
            _condition("Ready", c.ready, ready_reason, ready_message),
            _condition("Active", c.active, "DemandAboveActivation" if c.active else "NoDemand", ""),
            _condition("Fallback", c.fallback, "MetricsStale" if c.fallback else "MetricsFresh", ""),
            _condition("Paused", c.paused, "Annotation" if c.paused else "NotPaused", ""),
        ],
        "notes": list(rec.notes),
    }
    if row is not None:
        status.update(
            desiredReplicas=row.desired,
            readyReplicas=row.ready,
            activatingReplicas=row.activating,
            warmSlots=row.warm,
            staleSlots=row.stale,
            coldRequestedReplicas=row.cold_requested,
            mode=row.mode,
            lastActiveTime=durations.rfc3339(row.last_active_at),
            lastScaleTime=durations.rfc3339(row.last_scale_at),
            override=msgspec.to_builtins(row.override) if row.override is not None else None,
            lastDecisions=[
                {"time": durations.rfc3339(d.ts), "desiredReplicas": d.desired, "reason": d.reason}
                for d in row.decisions
            ],
        )
    return {
        "apiVersion": scaledobject.API_VERSION,
        "kind": scaledobject.KIND,
        "metadata": meta,
        "spec": drop_none(msgspec.to_builtins(rec.spec)),
        "status": drop_none(status),
    }


def _as_list(items: list[Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": items}


# --- slots and models ---------------------------------------------------------------------------------------


def short_digest(digest: str | None) -> str:
    """A content digest as a table cell: its algorithm and first 12 hex digits (``sha256:0123456789ab``), or ``-``."""
    if not digest:
        return "-"
    algo, sep, hexes = digest.partition(":")
    return f"{algo}:{hexes[:12]}" if sep else digest[:12]


def slot_rows(slots: Sequence[PoolSlot], *, wide: bool) -> tuple[list[str], list[list[str]]]:
    header = ["NAME", "MODEL", "NODE", "STATE", "AGENT", "RESIDENT", "ENDPOINT"]
    if wide:
        header += ["RACK", "ENGINE", "ROOTFS", "IMAGE", "REASON"]
    table = []
    for s in slots:
        state = s.state + (",drain" if s.drain and s.state != "draining" else "")
        cells = [s.key, s.model, s.node, state, s.agent, "yes" if s.resident else "no", s.endpoint or "-"]
        if wide:
            engine = "/".join(x for x in (s.engine, s.engine_mode) if x) or "-"
            rootfs = "mounted" if s.rootfs_mounted else "-"
            cells += [s.rack or "-", engine, rootfs, short_digest(s.image_digest), s.reason or "-"]
        table.append(cells)
    return header, table


def model_rows(rows: Sequence[StatusRow], now: float, *, wide: bool) -> tuple[list[str], list[list[str]]]:
    header = ["NAME", "SCALEDOBJECT", "DESIRED", "READY", "ACTIVATING", "WARM", "MODE", "LAST-SCALE"]
    if wide:
        header += ["STALE", "COLD", "OVERRIDE", "REASON"]
    table = []
    for r in rows:
        last = durations.age(now - r.last_scale_at) if r.last_scale_at is not None else "-"
        mode = r.mode + (",panic" if r.panic and "panic" not in r.mode else "")
        cells = [r.model, r.key or r.scaler, str(r.desired), str(r.ready), str(r.activating), str(r.warm), mode, last]
        if wide:
            o = r.override
            override = "-" if o is None else f"{o.kind} {o.replicas if o.replicas is not None else 'current'}"
            cells += [str(r.stale), str(r.cold_requested), override, r.reason or "-"]
        table.append(cells)
    return header, table


# --- get -----------------------------------------------------------------------------------------------------------


def kind_arg(text: str) -> str:
    kind = KINDS.get(text.lower())
    if kind is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a kind pulsescale lists: use scaledobjects (so), slots or models"
        )
    return kind


@dataclass
class _View:
    """One read of a kind: keys in order, each with what decides "changed" (for -w), its table row and its object."""

    header: list[str]
    items: list[tuple[str, tuple[Any, ...], list[str], Any]]


async def _read_view(nc: Client, kind: str, args: argparse.Namespace, now: float) -> _View:
    wide = args.output == "wide"
    if kind == "scaledobject":
        records = await read_scalers(nc)
        if not args.all_namespaces:
            records = [r for r in records if r.namespace == args.namespace]
        if args.name:
            records = [r for r in records if r.name == args.name]
        if args.selector:
            selected = labels.parse_selector(args.selector)
            records = [r for r in records if selected(r.labels)]
        rows = await read_status(nc, args, required=False) if records else []
        header, table = scaledobject_rows(records, rows, now, wide=wide, namespaces=args.all_namespaces)
        items = []
        for rec, cells in zip(records, table, strict=True):
            row = row_for(rec, rows or [])
            obj = manifest(rec, row, rows is not None, now)
            # AGE ticks every second: a row is "changed" for -w when anything but its age changed.
            age_at = header.index("AGE")
            same = tuple(c for i, c in enumerate(cells) if i != age_at)
            items.append((rec.key, same, cells, obj))
        return _View(header, items)
    if kind == "slot":
        pool = await read_pool(nc, args)
        slots = [s for s in pool.slots if not args.name or s.key == args.name]
        header, table = slot_rows(slots, wide=wide)
        return _View(header, [(s.key, tuple(c), c, s) for s, c in zip(slots, table, strict=True)])
    status_rows = await read_status(nc, args, required=True) or []
    status_rows = [r for r in status_rows if not args.name or r.model == args.name]
    header, table = model_rows(status_rows, now, wide=wide)
    last = header.index("LAST-SCALE")
    return _View(
        header,
        [
            (r.model, tuple(x for i, x in enumerate(c) if i != last), c, r)
            for r, c in zip(status_rows, table, strict=True)
        ],
    )


_NAME_PREFIX: Final = {"scaledobject": "scaledobject.pulsescale.io", "slot": "slot", "model": "model"}


def _print_view(view: _View, kind: str, args: argparse.Namespace, keys: Sequence[str], *, header: bool) -> None:
    chosen = [item for item in view.items if item[0] in keys]
    fmt = args.output
    if fmt in out.MACHINE_FORMATS:
        objs = [msgspec.to_builtins(obj) for _, _, _, obj in chosen]
        if args.name and len(objs) == 1:
            print(out.dump(objs[0], fmt))
        elif kind == "scaledobject" and not args.watch:
            print(out.dump(_as_list(objs), fmt))
        elif args.watch:
            for o in objs:
                print(out.dump(o, fmt) if fmt == "json" else "---\n" + out.dump(o, fmt))
        else:
            print(out.dump(objs, fmt))
    elif fmt is not None and fmt.startswith("jsonpath="):
        objs = [msgspec.to_builtins(obj) for _, _, _, obj in chosen]
        # As kubectl: one object named, the object; otherwise a List of them.
        data = objs[0] if args.name and len(objs) == 1 else _as_list(objs)
        print(jsonpath.render(fmt.removeprefix("jsonpath="), data), end="")  # as kubectl: no newline of its own
    elif fmt == "name":
        for key, _, cells, _ in chosen:
            name = cells[1] if kind == "scaledobject" and args.all_namespaces else cells[0]
            print(f"{_NAME_PREFIX[kind]}/{name if kind == 'scaledobject' else key}")
    else:
        text = out.table(view.header, [cells for _, _, cells, _ in chosen])
        print(text if header and not args.no_headers else "\n".join(text.splitlines()[1:]))
    sys.stdout.flush()


async def _get(nc: Client, kind: str, args: argparse.Namespace) -> int:
    view = await _read_view(nc, kind, args, time.time())
    if args.name and not view.items:
        where = f" in namespace {args.namespace}" if kind == "scaledobject" and not args.all_namespaces else ""
        raise CommandFailed(f'{kind} "{args.name}" not found{where}', EXIT_REFUSED)
    if not view.items and not args.watch and args.output not in out.MACHINE_FORMATS:
        where = f" in namespace {args.namespace}" if kind == "scaledobject" and not args.all_namespaces else ""
        print(f"No {kind}s found{where}.", file=sys.stderr)  # kubectl says so on stderr: stdout stays empty
        return 0
    _print_view(view, kind, args, [k for k, *_ in view.items], header=True)
    if not args.watch:
        return 0
    seen = {key: same for key, same, _, _ in view.items}
    printed_header = bool(view.items)
    while True:
        await asyncio.sleep(args.watch_every)
        view = await _read_view(nc, kind, args, time.time())
        changed = [key for key, same, _, _ in view.items if seen.get(key) != same]
        seen = {key: same for key, same, _, _ in view.items}
        if changed:
            _print_view(view, kind, args, changed, header=not printed_header)
            printed_header = True


def _get_parser(prog: str) -> argparse.ArgumentParser:
    p = parser(
        prog,
        "List ScaledObjects (from pulse_scalers, with the autoscaler's status), slots (the warm pool) or models "
        "(the autoscaler's status), as kubectl get does.",
        output_extra=("wide", "name"),
        by=False,
        templates=True,
    )
    p.add_argument("kind", type=kind_arg, metavar="KIND", help="scaledobjects (so, pso), slots or models")
    p.add_argument("name", nargs="?", metavar="NAME", help="only this one (a slot by its key)")
    ns = p.add_mutually_exclusive_group()
    ns.add_argument(
        "-n", "--namespace", default=scaledobject.DEFAULT_NAMESPACE, help="ScaledObjects of this namespace [default]"
    )
    ns.add_argument("-A", "--all-namespaces", action="store_true", help="ScaledObjects of every namespace")
    p.add_argument("-w", "--watch", action="store_true", help="keep polling; print a row when it changes (Ctrl-C)")
    p.add_argument("--no-headers", action="store_true", help="tables without their header row, as kubectl's")
    p.add_argument(
        "-l",
        "--selector",
        metavar="SELECTOR",
        help="ScaledObjects whose labels match, as kubectl's (key=value, key!=value, key in (a,b), key notin (a,b), "
        "key, !key; comma: all of them)",
    )
    p.add_argument(
        "--watch-every",
        type=durations.duration_arg(),
        default=DEFAULT_WATCH_EVERY_S,
        metavar="DURATION",
        help=f"with -w: poll this often [{durations.format_duration(DEFAULT_WATCH_EVERY_S)}]",
    )
    return p


def get(argv: list[str], prog: str) -> int:
    p = _get_parser(prog)
    args = p.parse_args(argv)
    if args.selector is not None:
        if args.kind != "scaledobject":
            p.error(f"-l: only ScaledObjects carry labels, not {args.kind}s")
        try:
            labels.parse_selector(args.selector)
        except labels.SelectorError as err:
            p.error(f"-l {args.selector}: {err}")
    if args.output is not None and args.output.startswith("jsonpath="):
        try:  # a template it cannot read is bad input, said before connecting
            jsonpath.render(args.output.removeprefix("jsonpath="), {})
        except jsonpath.JsonPathError as err:
            p.error(f"-o {args.output}: {err}")
    return run_reads(prog, args, "pulsescale-get", lambda nc: _get(nc, args.kind, args))
