"""`pulsescale get`: ScaledObjects, slots and models as kubectl lists resources; what `describe` reads too.

Where each kind comes from:

- **scaledobjects** (``so``): the records in KV `pulse_scalers` (what the operator or `apply` wrote) and what the
  CRs say, KV `pulse_objects` (the operator's copy of each CR's conditions, published or not; revision 13), joined
  with the autoscaler's ``status`` rows by `StatusRow.key` (by the model for an autoscaler without the key). The
  table has KEDA's ``kubectl get so`` columns. A mirrored object shows its CR's conditions (one never published:
  READY False, its reason in ``-o wide``); another (`apply` with no operator, or before revision 13) is Ready when
  the autoscaler runs it, READY, ACTIVE and FALLBACK ``Unknown`` when none answers (it is listed all the same).
  A NATS user refused `pulse_objects` (an on-call authorization rendered before revision 13) reads it as missing:
  the records alone, with one warning on stderr naming the fix (`objects_refused`).
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
from nats.aio.client import Client

from manifests import crdtypes, scaledobject
from oncall import jsonpath, labels
from oncall.client import EXIT_REFUSED, CommandFailed, parser, request, run_reads
from oncall.objects import (
    KV_TIMEOUT_S,
    ScaledObjectView,
    created,
    objects_refused,
    read_records,
    read_scaledobjects,
)
from warmpool import durations
from warmpool import output as out
from warmpool.protocol import (
    PoolCommand,
    PoolReply,
    PoolSlot,
    ScalerRecord,
    StatusCommand,
    StatusReply,
    StatusRow,
)

__all__ = [
    "ACTIVE_WITHIN_S",
    "DEFAULT_WATCH_EVERY_S",
    "KINDS",
    "KV_TIMEOUT_S",
    "Conditions",
    "ScaledObjectView",
    "created",
    "drop_none",
    "get",
    "kind_arg",
    "manifest",
    "model_rows",
    "objects_refused",
    "pause_annotations",
    "read_pool",
    "read_records",
    "read_scaledobjects",
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


# --- reading -------------------------------------------------------------------------------------------------------


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


def row_for(rec: ScalerRecord | ScaledObjectView, rows: Sequence[StatusRow]) -> StatusRow | None:
    """The status row of a ScaledObject: by key, else (an autoscaler before revision 5's key) by model; an object
    never published has none (its model's row is another object's)."""
    for r in rows:
        if r.key == rec.key:
            return r
    record = rec.record if isinstance(rec, ScaledObjectView) else rec
    model = record.spec.model if record is not None else None
    return next((r for r in rows if model is not None and r.key is None and r.model == model), None)


# --- ScaledObjects --------------------------------------------------------------------------------------------


def tf(value: bool | None) -> str:
    return "Unknown" if value is None else ("True" if value else "False")


def _active(row: StatusRow, now: float) -> bool:
    # KEDA's rule, as the CR's condition: replicas (desired > 0) are not activity.
    return crdtypes.scaler_active(row.last_active_at, now, ACTIVE_WITHIN_S)


_STATUS: Final = {"True": True, "False": False}


@dataclass(frozen=True)
class Conditions:
    """KEDA's four conditions of one ScaledObject; None = Unknown (no autoscaler answered, or so says the CR)."""

    ready: bool | None
    active: bool | None
    fallback: bool | None
    paused: bool | None
    ready_reason: str = ""
    ready_message: str = ""

    @staticmethod
    def of(rec: ScalerRecord, row: StatusRow | None, status_known: bool, now: float) -> Conditions:
        """Without the CR's word (no mirror): Ready is "the autoscaler runs it"."""
        paused = rec.paused or rec.paused_scale_in or rec.paused_scale_out or (row is not None and row.paused)
        if not status_known:
            return Conditions(None, None, None, paused, "Unknown", "no autoscaler answered the status request")
        if row is None:
            return Conditions(False, False, False, paused, "NotRunning", "the autoscaler has no row for it")
        return Conditions(True, _active(row, now), row.fallback, paused, "AutoscalerRunsIt", "the autoscaler scales it")

    @staticmethod
    def of_view(view: ScaledObjectView, row: StatusRow | None, status_known: bool, now: float) -> Conditions:
        """As the CR says where the operator mirrors it (revision 13), else `of`."""
        if view.cr is None:
            assert view.record is not None
            return Conditions.of(view.record, row, status_known, now)
        c = {k: view.cr.condition(k) for k in ("Ready", "Active", "Fallback", "Paused")}
        status = {k: None if v is None else _STATUS.get(v.status) for k, v in c.items()}
        ready = c["Ready"]
        return Conditions(status["Ready"], status["Active"], status["Fallback"], status["Paused"],
                          ready.reason if ready else "", ready.message if ready else "")  # fmt: skip


def _spec_cells(view: ScaledObjectView) -> list[str]:
    """TARGET, MIN, MAX: of the record in force, else as far as the operator could read the CR."""
    if view.record is not None:
        s = view.record.spec
        return [f"{s.scale_target_ref.kind}/{s.scale_target_ref.name}", str(s.min_replica_count),
                str(s.max_replica_count)]  # fmt: skip
    cr = view.cr
    assert cr is not None
    return [cr.target or "-", *("-" if n is None else str(n) for n in (cr.min_replicas, cr.max_replicas))]


def scaledobject_rows(
    views: Sequence[ScaledObjectView], rows: Sequence[StatusRow] | None, now: float, *, wide: bool, namespaces: bool
) -> tuple[list[str], list[list[str]]]:
    """The table of `get so`: KEDA's columns (``kubectl get so``); wide adds MODEL, DESIRED, WARM, MODE and REASON
    (the Ready condition's: why an unpublished object is not running)."""
    header = ["NAME", "TARGET", "MIN", "MAX", "READY", "ACTIVE", "FALLBACK", "PAUSED", "AGE"]
    if wide:
        header += ["MODEL", "DESIRED", "WARM", "MODE", "REASON"]
    if namespaces:
        header = ["NAMESPACE", *header]
    table = []
    for view in views:
        row = row_for(view, rows or [])
        c = Conditions.of_view(view, row, rows is not None, now)
        cells = [view.name, *_spec_cells(view), tf(c.ready), tf(c.active), tf(c.fallback), tf(c.paused)]
        cells.append(durations.age(now - view.created))
        if wide:
            counts = [str(row.desired), str(row.warm), row.mode] if row is not None else ["-", "-", "-"]
            cells += [view.model or "-", *counts, c.ready_reason or "-"]
        table.append([view.namespace, *cells] if namespaces else cells)
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


def _conditions(view: ScaledObjectView, row: StatusRow | None, status_known: bool, now: float) -> list[Any]:
    if view.cr is not None:  # as the CR has them (revision 13)
        return [
            {"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
             "lastTransitionTime": durations.rfc3339(c.since)}
            for c in view.cr.conditions
        ]  # fmt: skip
    c = Conditions.of_view(view, row, status_known, now)
    return [
        _condition("Ready", c.ready, c.ready_reason, c.ready_message),
        _condition("Active", c.active, "DemandAboveActivation" if c.active else "NoDemand", ""),
        _condition("Fallback", c.fallback, "MetricsStale" if c.fallback else "MetricsFresh", ""),
        _condition("Paused", c.paused, "Annotation" if c.paused else "NotPaused", ""),
    ]


def manifest(
    rec: ScalerRecord | ScaledObjectView, row: StatusRow | None, status_known: bool, now: float
) -> dict[str, Any]:
    """A ScaledObject as ``-o json|yaml`` prints it: apiVersion, kind, metadata, spec (camelCase, defaults
    filled in, nulls left out) and status (conditions, replica counts, last times in RFC 3339, decisions). An
    object never published has no spec here (only its CR holds it): applied back, it is refused, not guessed."""
    view = rec if isinstance(rec, ScaledObjectView) else ScaledObjectView.of(rec, None)
    record, cr = view.record, view.cr
    generation = record.generation if record is not None else cr.generation if cr is not None else None
    meta: dict[str, Any] = {"name": view.name, "namespace": view.namespace}
    if generation is not None:
        meta["generation"] = generation
    meta["creationTimestamp"] = durations.rfc3339(view.created)
    if view.labels:
        meta["labels"] = dict(view.labels)
    annotations = pause_annotations(record) if record is not None else {}
    if annotations:
        meta["annotations"] = annotations
    status: dict[str, Any] = {
        "conditions": _conditions(view, row, status_known, now),
        "observedGeneration": cr.generation if cr is not None else None,
        "notes": list(record.notes) if record is not None else None,
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
    obj: dict[str, Any] = {"apiVersion": scaledobject.API_VERSION, "kind": scaledobject.KIND, "metadata": meta}
    if record is not None:
        obj["spec"] = drop_none(msgspec.to_builtins(record.spec))
    obj["status"] = drop_none(status)
    return obj


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
        views = await read_scaledobjects(nc, args)
        if not args.all_namespaces:
            views = [v for v in views if v.namespace == args.namespace]
        if args.name:
            views = [v for v in views if v.name == args.name]
        if args.selector:
            selected = labels.parse_selector(args.selector)
            views = [v for v in views if selected(v.labels)]
        rows = await read_status(nc, args, required=False) if views else []
        header, table = scaledobject_rows(views, rows, now, wide=wide, namespaces=args.all_namespaces)
        items = []
        for view, cells in zip(views, table, strict=True):
            row = row_for(view, rows or [])
            obj = manifest(view, row, rows is not None, now)
            # AGE ticks every second: a row is "changed" for -w when anything but its age changed.
            age_at = header.index("AGE")
            same = tuple(c for i, c in enumerate(cells) if i != age_at)
            items.append((view.key, same, cells, obj))
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
        "List ScaledObjects (from pulse_scalers and what their CRs say in pulse_objects, with the autoscaler's "
        "status), slots (the warm pool) or models (the autoscaler's status), as kubectl get does.",
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
    return run_reads(prog, args, "pulsescale-get", lambda nc: _get(nc, args.kind, args), refused=objects_refused(args))
