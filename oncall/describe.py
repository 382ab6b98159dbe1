"""`pulsescale describe KIND NAME`: one ScaledObject, slot or model in detail, as kubectl describes a resource.

Read as `get` reads them (`oncall.get`): a ScaledObject from KV `pulse_scalers` and what its CR says (KV
`pulse_objects`, contract revision 13: its conditions with their reasons and messages, also for one the operator
refused and never published) joined with the autoscaler's status row (every field, conditions, notes, pause
state, override, schedules and the last decisions with their times), a slot from the ``pool`` reply, a model from
the ``status`` rows. ``-o json|yaml`` prints the object itself: a ScaledObject as its manifest (what ``get so NAME
-o`` prints). Exit codes as the on-call verbs (`oncall.client`): 1 when the object is not found, 3/4 when the
autoscaler does not answer a read that needs it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec
from nats.aio.client import Client

from manifests import scaledobject
from oncall.client import EXIT_REFUSED, CommandFailed, parser, run_reads
from oncall.get import (
    Conditions,
    ScaledObjectView,
    drop_none,
    kind_arg,
    manifest,
    objects_refused,
    pause_annotations,
    read_pool,
    read_scaledobjects,
    read_status,
    row_for,
    tf,
)
from oncall.verbs import schedule_lines
from warmpool import durations
from warmpool import output as out
from warmpool.output import replicas_text
from warmpool.protocol import ObjectStatus, PoolSlot, ScalerRecord, StatusRow

__all__ = [
    "KEDA_PAUSED",
    "KEDA_PAUSED_REPLICAS",
    "KEDA_PAUSED_SCALE_IN",
    "KEDA_PAUSED_SCALE_OUT",
    "describe",
    "describe_model",
    "describe_scaledobject",
    "describe_slot",
]

KEDA_PAUSED_SCALE_IN: Final = "autoscaling.keda.sh/paused-scale-in"
KEDA_PAUSED_SCALE_OUT: Final = "autoscaling.keda.sh/paused-scale-out"
KEDA_PAUSED: Final = "autoscaling.keda.sh/paused"
KEDA_PAUSED_REPLICAS: Final = "autoscaling.keda.sh/paused-replicas"
"""KEDA's pause annotations: the ScaledObject reader takes them as ours (`scaledobject.PAUSED_ANNOTATION`, ...);
`describe` names both families."""


def _when(ts: float | None, now: float) -> str:
    if ts is None:
        return "<none>"
    delta = now - ts
    rel = f"{durations.age(delta)} ago" if delta >= 0 else f"in {durations.age(-delta)}"
    return f"{durations.rfc3339(ts)} ({rel})"


def _fields(pairs: Sequence[tuple[str, Any]], indent: str = "") -> list[str]:
    width = max(len(k) for k, _ in pairs) + 2
    return [f"{indent}{(k + ':').ljust(width)}{'<none>' if v is None else v}" for k, v in pairs]


def _decision_lines(row: StatusRow, now: float) -> list[str]:
    if not row.decisions:
        return ["Decisions:    <none>"]
    table = out.table(
        ["TIME", "AGE", "DESIRED", "REASON"],
        [[durations.rfc3339(d.ts), durations.age(now - d.ts), d.desired, d.reason] for d in row.decisions],
    )
    return ["Decisions (newest last):", *("  " + line for line in table.splitlines())]


def _pause_text(rec: ScalerRecord, row: StatusRow | None) -> list[tuple[str, Any]]:
    if rec.paused_replicas is not None:
        paused = f"true, at {replicas_text(rec.paused_replicas)}"
    elif rec.paused:
        paused = "true, at the current count"
    else:
        paused = "false"
    if row is not None and row.paused and not rec.paused:
        o = row.override
        by = f" by {o.by}" if o is not None and o.by else ""
        paused = f"true, by an on-call pause{by} (`pulsescale resume {rec.spec.model}`)"
    return [
        ("Paused", paused),
        ("Paused scale-in", str(rec.paused_scale_in).lower()),
        ("Paused scale-out", str(rec.paused_scale_out).lower()),
        (
            "Pause annotations",
            f"{scaledobject.PAUSED_ANNOTATION}, {scaledobject.PAUSED_REPLICAS_ANNOTATION} and KEDA's {KEDA_PAUSED}, "
            f"{KEDA_PAUSED_REPLICAS}, {KEDA_PAUSED_SCALE_IN}, {KEDA_PAUSED_SCALE_OUT} (the same meaning)",
        ),
    ]


def _cr_lines(cr: ObjectStatus, now: float) -> list[str]:
    """The CR's conditions as the operator wrote them (revision 13), with their reasons and messages."""
    head = f"Conditions (the CR's, generation {cr.generation if cr.generation is not None else '?'}, mirrored "
    table = out.table(
        ["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"],
        [[c.type, c.status, c.reason or "-", "-" if c.since is None else durations.age(now - c.since),
          c.message.replace("\n", " ") or "-"] for c in cr.conditions],
    )  # fmt: skip
    return [head + f"{_when(cr.updated_at, now)}):", *("  " + line for line in table.splitlines())]


def _unpublished(cr: ObjectStatus, now: float) -> str:
    """An object the operator never published: what it could read of the CR, and why (its conditions)."""
    ready = cr.condition("Ready")
    lines = _fields(
        [
            ("Name", cr.name),
            ("Namespace", cr.namespace),
            ("Model", cr.model),
            ("Target", cr.target),
            ("Replicas", f"min {cr.min_replicas if cr.min_replicas is not None else '<none>'}, max "
                         f"{cr.max_replicas if cr.max_replicas is not None else '<none>'}"),
            ("Created", _when(cr.created_at, now)),
            ("Labels", ", ".join(f"{k}={v}" for k, v in cr.labels.items()) or None),
            ("Published", f"no ({ready.reason if ready and ready.reason else 'see the conditions'}): nothing "
                          "scales it; the Ready message says why and what to do"),
        ]
    )  # fmt: skip
    return "\n".join(lines + _cr_lines(cr, now))


def describe_scaledobject(
    rec: ScalerRecord | ScaledObjectView, row: StatusRow | None, status_known: bool, now: float
) -> str:
    view = rec if isinstance(rec, ScaledObjectView) else ScaledObjectView.of(rec, None)
    if view.record is None:
        assert view.cr is not None
        return _unpublished(view.cr, now)
    rec = view.record
    s = rec.spec
    t = s.scale_target_ref
    annotations = pause_annotations(rec)
    lines = _fields(
        [
            ("Name", rec.name),
            ("Namespace", rec.namespace),
            ("Model", s.model),
            ("Target", f"{t.kind}/{t.name} ({t.api_version})"),
            ("Created", _when(view.created, now)),
            ("Updated", _when(rec.updated_at or None, now)),
            ("Generation", rec.generation),
            ("Labels", ", ".join(f"{k}={v}" for k, v in view.labels.items()) or None),
            ("Annotations", ", ".join(f"{k}: {v}" for k, v in annotations.items()) or None),
            *_pause_text(rec, row),
        ]
    )
    spec_yaml = out.dump(drop_none(msgspec.to_builtins(s)), "yaml")
    lines += ["Spec:", *("  " + line for line in spec_yaml.splitlines())]
    lines += ["Notes:", *(f"  - {n}" for n in rec.notes)] if rec.notes else ["Notes:        <none>"]
    if view.cr is not None:
        lines += _cr_lines(view.cr, now)
    else:
        c = Conditions.of(rec, row, status_known, now)
        lines.append("Conditions:")
        conditions = [
            ["Ready", tf(c.ready)],
            ["Active", tf(c.active)],
            ["Fallback", tf(c.fallback)],
            ["Paused", tf(c.paused)],
        ]
        lines += ["  " + line for line in out.table(["TYPE", "STATUS"], conditions).splitlines()]
    if not status_known:
        lines.append("Status:       unknown (no autoscaler answered the status request)")
        return "\n".join(lines)
    if row is None:
        lines.append("Status:       the autoscaler has no row for it (it has not read the record yet?)")
        return "\n".join(lines)
    lines.append("Status:")
    o = row.override
    override = None
    if o is not None:
        held = replicas_text(o.replicas) if o.replicas is not None else "the current count"
        until = f" until {_when(o.expires_at, now)}" if o.expires_at is not None else " until resumed"
        override = f"{o.kind} at {held}{until}" + (f" by {o.by}" if o.by else "")
    lines += _fields(
        [
            ("Desired replicas", row.desired),
            ("Ready replicas", row.ready),
            ("Activating", row.activating),
            ("Warm slots", f"{row.warm} (stale {row.stale})"),
            ("Cold path asked", row.cold_requested),
            ("Mode", row.mode + (", panic" if row.panic and "panic" not in row.mode else "")),
            ("Override", override),
            ("Last reason", row.reason or None),
            ("Last active", _when(row.last_active_at, now)),
            ("Last scale", _when(row.last_scale_at, now)),
        ],
        indent="  ",
    )
    if row.schedules:
        lines += ["  Schedules:", *schedule_lines(row.schedules, now, indent="    ")]
    lines += _decision_lines(row, now)
    return "\n".join(lines)


def describe_slot(slot: PoolSlot) -> str:
    fields = msgspec.to_builtins(slot)
    return "\n".join(_fields([(k.replace("_", " ").capitalize(), v) for k, v in fields.items()]))


def describe_model(row: StatusRow, now: float) -> str:
    o = row.override
    override = None if o is None else f"{o.kind} {o.replicas if o.replicas is not None else 'current count'}"
    if o is not None and o.expires_at is not None:
        override = f"{override} until {_when(o.expires_at, now)}"
    lines = _fields(
        [
            ("Name", row.model),
            ("ScaledObject", row.key or row.scaler),
            ("Desired", row.desired),
            ("Ready", row.ready),
            ("Activating", row.activating),
            ("Warm slots", f"{row.warm} (stale {row.stale})"),
            ("Mode", row.mode + (", panic" if row.panic and "panic" not in row.mode else "")),
            ("Paused", str(row.paused).lower()),
            ("Fallback", str(row.fallback).lower()),
            ("Cold path asked", row.cold_requested),
            ("Override", override),
            ("Last reason", row.reason or None),
            ("Last active", _when(row.last_active_at, now)),
            ("Last scale", _when(row.last_scale_at, now)),
            ("Scheduled floor", row.scheduled_floor),
        ]
    )
    if row.schedules:
        lines += ["Schedules:", *schedule_lines(row.schedules, now)]
    return "\n".join(lines + _decision_lines(row, now))


async def _describe(nc: Client, args: argparse.Namespace) -> int:
    """The text view, or with -o json|yaml the object itself: a ScaledObject as its manifest (what `get so NAME
    -o` prints), a slot or a model as the autoscaler's reply has it."""
    now = time.time()
    fmt = out.machine(args)
    if args.kind == "scaledobject":
        key = f"{args.namespace}.{args.name}"
        views = [v for v in await read_scaledobjects(nc, args) if v.key == key]
        if not views:
            raise CommandFailed(
                f'scaledobject "{args.name}" not found in namespace {args.namespace} (`pulsescale get so -A` lists '
                "them)",
                EXIT_REFUSED,
            )
        rows = await read_status(nc, args, required=False)
        view = views[0]
        row = row_for(view, rows or [])
        if fmt is not None:
            print(out.dump(manifest(view, row, rows is not None, now), fmt))
        else:
            print(describe_scaledobject(view, row, rows is not None, now))
    elif args.kind == "slot":
        pool = await read_pool(nc, args)
        slots = [s for s in pool.slots if s.key == args.name]
        if not slots:
            raise CommandFailed(f'slot "{args.name}" not found (`pulsescale get slots` lists them)', 1)
        print(out.dump(slots[0], fmt) if fmt is not None else describe_slot(slots[0]))
    else:
        rows = [r for r in await read_status(nc, args, required=True) or [] if r.model == args.name]
        if not rows:
            raise CommandFailed(f'model "{args.name}" not found (`pulsescale get models` lists them)', 1)
        print(out.dump(rows[0], fmt) if fmt is not None else describe_model(rows[0], now))
    return 0


def describe(argv: list[str], prog: str) -> int:
    # Its own parser: get's -A, -w, wide and name mean nothing for one object.
    p = parser(prog, "Show one ScaledObject, slot or model in detail: every field, conditions, notes, "
                      "pause state and the last decisions with their times; -o json|yaml prints the object.",
                      by=False)  # fmt: skip
    p.add_argument("kind", type=kind_arg, metavar="KIND", help="scaledobject (so), slot or model")
    p.add_argument("name", metavar="NAME", help="the ScaledObject's or model's name, or the slot's key")
    p.add_argument("-n", "--namespace", default=scaledobject.DEFAULT_NAMESPACE, help="the ScaledObject's [default]")
    args = p.parse_args(argv)
    return run_reads(prog, args, "pulsescale-describe", lambda nc: _describe(nc, args), refused=objects_refused(args))
