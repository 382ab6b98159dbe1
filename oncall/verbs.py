"""On-call verbs: `pulsescale scale|pause|resume|schedule|status|pool|drain|undrain`, and how their replies read.

Each verb sends one command of the contract on ``pulse.cmd.<verb>`` (`client.run`) and prints its typed reply
(`protocol.OverrideReply`, `ScheduleReply`, `StatusReply`, `PoolReply`, `DrainReply`) as text here, or with
``-o json|yaml`` as its fields. Exit codes as every on-call command (`oncall.client`).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

from oncall.client import (
    bounded_duration,
    format_duration,
    name_arg,
    parse_duration,
    parser,
    replicas_arg,
    run,
)
from warmpool import durations, protocol
from warmpool import output as out
from warmpool.output import replicas_text
from warmpool.protocol import (
    MAX_OVERRIDE_S,
    DrainCommand,
    DrainReply,
    OverrideReply,
    PauseCommand,
    PoolCommand,
    PoolReply,
    ReplicaRecord,
    ResumeCommand,
    ScaleCommand,
    Schedule,
    ScheduleCommand,
    ScheduleReply,
    ScheduleRow,
    StatusCommand,
    StatusReply,
    StatusRow,
    UndrainCommand,
)

__all__ = [
    "DEFAULT_FOR",
    "SKEW_SHOWN_S",
    "drain",
    "format_pool",
    "format_replicas",
    "format_schedules",
    "format_shards",
    "format_skew",
    "format_status",
    "pause",
    "pool",
    "resume",
    "scale",
    "schedule",
    "schedule_lines",
    "status",
    "undrain",
]

DEFAULT_FOR: Final = "1h"
"""How long `scale` holds a model without --for: an incident's length; a forgotten override lapses by itself."""


def _override_duration_arg(text: str) -> float:
    return bounded_duration(
        text, MAX_OVERRIDE_S, "an override may last", "scale again when it lapses, or use `pause`, which holds until "
        "`resume`"
    )  # fmt: skip


def _when(ts: float, now: float) -> str:
    """A time as RFC 3339 (UTC) with how long ago or ahead it is: ``2026-12-03T07:41:05Z (5m ago)``."""
    delta = now - ts
    rel = f"{durations.age(delta)} ago" if delta >= 0 else f"in {durations.age(-delta)}"
    return f"{durations.rfc3339(ts)} ({rel})"


def _describe_override(o: protocol.Override | None, now: float) -> str:
    if o is None:
        return "-"
    text = f"{o.kind} {o.replicas}" if o.replicas is not None else f"{o.kind} (current count)"
    if o.expires_at is not None:
        text += f", {format_duration(o.expires_at - now)} left"
    return f"{text} by {o.by}" if o.by else text


# --- the verbs -----------------------------------------------------------------------------------------------------


def scale(argv: list[str], prog: str) -> int:
    p = parser(prog, "Hold a model at N replicas for a while; the policy takes over again when it lapses.")
    p.add_argument("model", type=name_arg("model"))
    p.add_argument("--replicas", type=replicas_arg, required=True, metavar="N")
    p.add_argument(
        "--for",
        dest="for_s",
        type=_override_duration_arg,
        default=parse_duration(DEFAULT_FOR),
        metavar="DURATION",
        help=f"how long the override lasts: 90s, 10m, 2h, 1h30m; at most {format_duration(MAX_OVERRIDE_S)} "
        f"[{DEFAULT_FOR}]",
    )
    args = p.parse_args(argv)

    def build(**envelope: Any) -> ScaleCommand:
        return ScaleCommand(**envelope, model=args.model, replicas=args.replicas, for_s=args.for_s)

    def show(reply: OverrideReply) -> None:
        o = reply.override
        until = o.expires_at if o is not None else None
        when = f" until {durations.rfc3339(until)} ({format_duration(args.for_s)})" if until else ""
        replicas = o.replicas if o is not None and o.replicas is not None else args.replicas
        print(f"{args.model} held at {replicas_text(replicas)}{when} by {o.by if o is not None else '?'}")

    return run(prog, args, "scale", build, OverrideReply, show)


def pause(argv: list[str], prog: str) -> int:
    p = parser(prog, "Stop autoscaling a model, at its current count or at --replicas N, until `resume`.")
    p.add_argument("model", type=name_arg("model"))
    p.add_argument("--replicas", type=replicas_arg, metavar="N", help="hold at N replicas [the current count]")
    args = p.parse_args(argv)

    def build(**envelope: Any) -> PauseCommand:
        return PauseCommand(**envelope, model=args.model, replicas=args.replicas)

    def show(_: OverrideReply) -> None:
        at = f"at {replicas_text(args.replicas)}" if args.replicas is not None else "at its current count"
        print(f"{args.model} paused {at}; `pulsescale resume {args.model}` hands it back to the policy")

    return run(prog, args, "pause", build, OverrideReply, show)


def resume(argv: list[str], prog: str) -> int:
    p = parser(prog, "End a model's override (scale or pause): the policy decides again.")
    p.add_argument("model", type=name_arg("model"))
    args = p.parse_args(argv)

    def build(**envelope: Any) -> ResumeCommand:
        return ResumeCommand(**envelope, model=args.model)

    return run(prog, args, "resume", build, OverrideReply, lambda _: print(f"{args.model} is autoscaled again"))


def _schedule_arg(text: str) -> float:
    return bounded_duration(
        text, protocol.MAX_SCHEDULE_S, "a schedule may hold", "a longer floor is a minReplicaCount edit"
    )


_LOCAL: Final = re.compile(r"([0-9]{4}-[0-9]{2}-[0-9]{2})[T ]([0-9]{2}:[0-9]{2}(:[0-9]{2})?)")


def _local_time_arg(text: str) -> str:
    """``2026-12-24T18:00`` or ``2026-12-24 18:00`` (seconds optional), no offset: the zone is --tz."""
    m = _LOCAL.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a local date-time: write 2026-12-24T18:00 (or '2026-12-24 18:00'), with the zone in --tz"
        )
    return f"{m.group(1)}T{m.group(2)}"


def _tag_free(err: Exception) -> str:
    return re.sub(r"^\[\w+\] ", "", str(err))


def schedule_lines(rows: Sequence[ScheduleRow], now: float, *, indent: str = "  ") -> list[str]:
    """One line per schedule: in force (with the time left) or upcoming (with when it starts)."""
    out_lines = []
    for r in rows:
        if r.active:
            when = f"in force until {_when(r.ends_at, now)}"
        elif r.starts_at > now:
            when = f"starts {_when(r.starts_at, now)}, for {format_duration(r.duration_seconds)}"
        else:
            when = f"ended {_when(r.ends_at, now)}"
        by = f" by {r.by}" if r.by else ""
        out_lines.append(
            f"{indent}{r.name} ({r.source}{by}): floor {replicas_text(r.replicas)} from {r.start} {r.timezone}; {when}"
        )
    return out_lines


def _schedule_cell(r: StatusRow, now: float) -> str:
    """The SCHEDULE column: the floor in force and until when, else the next one and when it starts."""
    active = [s for s in r.schedules if s.active]
    if active:
        top = max(active, key=lambda s: s.replicas)
        return f"{top.name}: floor {top.replicas}, {format_duration(max(top.ends_at - now, 0))} left"
    upcoming = [s for s in r.schedules if s.starts_at > now]
    if upcoming:
        nxt = upcoming[0]
        return f"next {nxt.name}: {nxt.replicas} in {durations.age(nxt.starts_at - now)}"
    return "-"


def format_schedules(reply: ScheduleReply, now: float) -> str:
    """``pulsescale schedule MODEL --list``: the model's schedules not yet ended, both sources, soonest first."""
    rows = reply.schedules
    if not rows:
        return (
            f"{reply.model}: no schedules (add one: pulsescale schedule {reply.model} --at ... --for ... --replicas N)"
        )
    header = ["NAME", "SOURCE", "REPLICAS", "START", "TIMEZONE", "FOR", "STATE", "BY"]
    table = [
        [
            r.name,
            r.source,
            str(r.replicas),
            r.start,
            r.timezone,
            format_duration(r.duration_seconds),
            (
                f"in force, {format_duration(max(r.ends_at - now, 0))} left"
                if r.active
                else f"starts {durations.rfc3339(r.starts_at)} (in {durations.age(r.starts_at - now)})"
            ),
            r.by or "-",
        ]
        for r in rows
    ]
    return out.table(header, table)


def schedule(argv: list[str], prog: str) -> int:
    p = parser(
        prog,
        "Raise a model's floor from a time, for a while, ahead of a known event (scheduled warm-up, as KEDA's cron "
        "scaler): the policy never goes below it meanwhile, and the warm pool is asked for the slots ahead of the "
        "start. Without --at or --delete, lists the model's schedules (its ScaledObject's and the on-call ones).",
    )
    p.add_argument("model", type=name_arg("model"))
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--at", type=_local_time_arg, metavar="LOCAL-TIME", help="start, local time in --tz: 2026-12-24T18:00"
    )
    act.add_argument("--delete", type=name_arg("schedule"), metavar="NAME", help="delete the on-call schedule NAME")
    act.add_argument("--list", action="store_true", help="list the model's schedules (the default)")
    p.add_argument("--tz", default="UTC", metavar="ZONE", help="IANA zone of --at: Europe/Berlin [UTC]")
    p.add_argument(
        "--for",
        dest="for_s",
        type=_schedule_arg,
        metavar="DURATION",
        help=f"how long the floor holds: 90m, 2h, 36h; at most {format_duration(protocol.MAX_SCHEDULE_S)}",
    )
    p.add_argument("--replicas", type=replicas_arg, metavar="N", help="the floor: at least N replicas")
    p.add_argument("--name", type=name_arg("schedule"), help="names the schedule [at-<date>-<time>]")
    args = p.parse_args(argv)
    add: Schedule | None = None
    if args.at is not None:
        if args.for_s is None or args.replicas is None:
            p.error("--at needs --for DURATION and --replicas N")
        name = args.name or "at-" + args.at.replace("T", "-").replace(":", "").lower()
        try:
            add = Schedule(
                name=name, start=args.at, timezone=args.tz, duration_seconds=args.for_s, replicas=args.replicas
            )
        except (ValueError, msgspec.ValidationError) as err:
            p.error(_tag_free(err))
    elif args.for_s is not None or args.replicas is not None or args.name is not None or args.tz != "UTC":
        p.error("--for, --replicas, --name and --tz go with --at")

    def build(**envelope: Any) -> ScheduleCommand:
        return ScheduleCommand(**envelope, model=args.model, add=add, delete=args.delete)

    def show(reply: ScheduleReply) -> None:
        now = time.time()
        if add is not None:
            begin, _ = add.window()
            print(
                f"{args.model}: schedule {add.name} added: floor {replicas_text(add.replicas)} from {add.start} "
                f"{add.timezone} ({_when(begin, now)}) for {format_duration(add.duration_seconds)}"
            )
        elif args.delete is not None:
            print(f"{args.model}: schedule {args.delete} deleted")
        print(format_schedules(reply, now))

    return run(prog, args, "schedule", build, ScheduleReply, show)


def format_status(
    rows: Sequence[StatusRow], now: float, *, replicas: Sequence[ReplicaRecord] = (), wide: bool = False
) -> str:
    """The `status` table; with one model, its recent decisions below it; then the autoscaler replicas when the
    reply names them. WARM counts the claimable slots; STALE the ones that read warm but whose agent's lease
    lapsed (not claimable until it heartbeats again). OWNER (the replica that owns the model's shard) shows when
    several replicas share the models, or with `wide`, which adds SHARD. SCHEDULE (revision 8) shows once any model
    has a schedule in force or to come: the floor in force and the time left, else the next one."""
    owner = wide or len(replicas) > 1
    scheduled = any(r.schedules for r in rows)
    header: tuple[str, ...] = (
        "MODEL", *(["OWNER"] if owner else []), *(["SHARD"] if wide else []),
        "DESIRED", "READY", "ACTIVATING", "WARM", "STALE", "MODE", "OVERRIDE", *(["SCHEDULE"] if scheduled else []),
        "LAST-REASON",
    )  # fmt: skip
    table = [header]
    for r in rows:
        mode = r.mode or "-"
        if r.panic and "panic" not in mode:
            mode += ",panic"
        counts = (r.desired, r.ready, r.activating, r.warm, r.stale)
        where = [
            *([r.owner or "-"] if owner else []),
            *([str(r.shard) if r.shard is not None else "-"] if wide else []),
        ]
        sched = [_schedule_cell(r, now)] if scheduled else []
        table.append(
            (r.model, *where, *map(str, counts), mode, _describe_override(r.override, now), *sched, r.reason or "-")
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in table]
    if not rows:
        lines.append("(no models: apply a ScaledObject with `pulsescale apply -f FILE.yaml`)")
    if len(rows) == 1 and rows[0].schedules:
        lines += ["", f"schedules of {rows[0].model} (in force, then the next):"]
        lines += schedule_lines(rows[0].schedules, now)
    if len(rows) == 1 and rows[0].decisions:
        lines += ["", f"recent decisions of {rows[0].model} (newest last):"]
        lines += [f"  {_when(d.ts, now)}  desired {d.desired:<4}  {d.reason}" for d in rows[0].decisions]
    if replicas:
        lines += ["", *format_replicas(replicas, now)]
    return "\n".join(line.rstrip() for line in lines)


def format_shards(shards: Sequence[int]) -> str:
    """Shards as ranges, with the count: ``0-10,12,14-15 (14)``; ``none`` for no shard."""
    if not shards:
        return "none"
    ordered = sorted(set(shards))
    runs: list[list[int]] = []
    for n in ordered:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"{text} ({len(ordered)})"


def format_replicas(replicas: Sequence[ReplicaRecord], now: float) -> list[str]:
    """The autoscaler replicas below the status table: one line for a single replica (nothing is sharded over
    it), a small table for several."""
    if len(replicas) == 1:
        r = replicas[0]
        return [
            f"1 replica: {r.identity}, shards {format_shards(r.shards)}, {r.models} model(s), "
            f"up {durations.age(now - r.started_at)}"
        ]
    rows = [
        (r.identity, format_shards(r.shards), str(r.models), durations.age(now - r.started_at))
        for r in sorted(replicas, key=lambda r: r.identity)
    ]
    header = ("REPLICA", "SHARDS", "MODELS", "AGE")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    table = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in [header, *rows]
    ]
    return [f"replicas: {len(replicas)}", *(f"  {line}" for line in table)]


def status(argv: list[str], prog: str) -> int:
    p = parser(
        prog,
        "Show models: desired/ready replicas, warm slots (STALE: warm but their agent's lease lapsed), mode, "
        "override and the last decision's reason; with several autoscaler replicas, which one owns each model "
        "(-o wide adds its shard), and the replicas.",
        output_extra=("wide",),
    )
    p.add_argument("model", nargs="?", type=name_arg("model"))
    args = p.parse_args(argv)

    def build(**envelope: Any) -> StatusCommand:
        return StatusCommand(**envelope, model=args.model)

    def warn(reply: StatusReply) -> None:
        # Replicas that did not answer: their models are missing (stderr: stdout stays data).
        if reply.missing:
            print(
                f"{prog}: warning: autoscaler replica(s) {', '.join(reply.missing)} did not answer in time: "
                "their models are missing; retry",
                file=sys.stderr,
            )

    def show(reply: StatusReply) -> None:
        warn(reply)
        print(format_status(reply.models, time.time(), replicas=reply.replicas, wide=args.output == "wide"))

    def machine_view(reply: StatusReply) -> Any:
        # -o json|yaml, times as Unix seconds like the wire: the rows, a list, whatever the number of replicas
        # (each row names its owner and shard), so a script's input keeps its shape when the autoscaler scales out.
        warn(reply)
        return reply.models

    return run(prog, args, "status", build, StatusReply, show, machine_view)


SKEW_SHOWN_S: Final = 0.5
"""`format_pool` adds a CLOCK column once an agent's clock is this far from the autoscaler's (milliseconds are the
heartbeat's travel; half a second is a clock that is off)."""


def format_skew(skew_s: float | None) -> str:
    """An agent's clock skew as a table cell: ``+3.0s`` (ahead of the autoscaler), ``-30.0s``, ``?`` (not heard)."""
    return "?" if skew_s is None else f"{skew_s:+.1f}s"


def format_pool(reply: PoolReply) -> str:
    """Slots grouped by model, each group headed by its counts by state. An ENGINE column (adapter/mode of the
    last activation, revision 4) appears once any slot's agent reports one; a CLOCK column (how far the agent's
    clock is from the autoscaler's, revision 10) once any is `SKEW_SHOWN_S` off, and then a line per such node."""
    lines: list[str] = []
    engines = any(s.engine for s in reply.slots)
    skewed: dict[str, float] = {}
    for s in reply.slots:
        if s.skew_s is not None and abs(s.skew_s) >= SKEW_SHOWN_S:
            skewed[s.node] = s.skew_s
    header: tuple[str, ...] = ("SLOT", "STATE", "NODE", "RACK", "AGENT", "RESIDENT", "ENDPOINT", "REASON")
    if engines:
        header = (*header[:6], "ENGINE", *header[6:])
    if skewed:
        header = (*header[:5], "CLOCK", *header[5:])
    for model, by_state in reply.counts.items():
        total = sum(by_state.values())
        summary = ", ".join(f"{state} {n}" for state, n in by_state.items())
        lines.append(f"{model}: {total} slot(s): {summary}")
        table = [header]
        for s in reply.slots:
            if s.model != model:
                continue
            state = s.state + (" (drain)" if s.drain and s.state != "draining" else "")
            resident = "yes" if s.resident else "no"
            row: tuple[str, ...] = (s.key, state, s.node, s.rack or "-", s.agent)
            if skewed:
                row += (format_skew(s.skew_s),)
            row += (resident,)
            if engines:
                row += ("/".join(x for x in (s.engine, s.engine_mode) if x) or "-",)
            table.append((*row, s.endpoint or "-", s.reason or ""))
        widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in table]
        lines.append("")
    for node, skew_s in sorted(skewed.items()):
        trust = (
            "its slots are not offered until it is set right"
            if abs(skew_s) > protocol.MAX_TRUSTED_SKEW_S
            else f"served as usual (up to {protocol.MAX_TRUSTED_SKEW_S:g} s is); check its chrony/NTP"
        )
        side = "ahead of" if skew_s > 0 else "behind"
        lines.append(f"clock of {node} is {abs(skew_s):.1f} s {side} the autoscaler's: {trust}")
    if skewed:
        lines.append("")
    if reply.truncated:
        lines.append(f"({reply.truncated} more slot(s) not shown: the reply is capped at 64 KiB; name a model)")
    if not reply.counts:
        lines.append("(no slots registered: are node agents running?)")
    return "\n".join(line.rstrip() for line in lines).rstrip()


def pool(argv: list[str], prog: str) -> int:
    p = parser(prog, "Show the warm pool: every slot by model, with counts by state.")
    p.add_argument("model", nargs="?", type=name_arg("model"))
    args = p.parse_args(argv)

    def build(**envelope: Any) -> PoolCommand:
        return PoolCommand(**envelope, model=args.model)

    return run(prog, args, "pool", build, PoolReply, lambda reply: print(format_pool(reply)))


def _drain_verb(verb: Literal["drain", "undrain"], argv: list[str], prog: str) -> int:
    what = (
        "Stop offering a node's slots: idle ones go to draining at once, serving ones when released."
        if verb == "drain"
        else "Offer a drained node's slots again."
    )
    p = parser(prog, what)
    p.add_argument("node", type=name_arg("node"))
    args = p.parse_args(argv)
    command = DrainCommand if verb == "drain" else UndrainCommand

    def build(**envelope: Any) -> DrainCommand | UndrainCommand:
        return command(**envelope, node=args.node)

    def show(reply: DrainReply) -> None:
        done = "drained" if verb == "drain" else "undrained"
        if not reply.touched:
            print(f"{args.node}: nothing to change (already {done})")
            return
        print(f"{args.node} {done}: {len(reply.touched)} slot(s) changed")
        for key in reply.touched:
            print(f"  {key}")

    return run(prog, args, verb, build, DrainReply, show)


def drain(argv: list[str], prog: str) -> int:
    return _drain_verb("drain", argv, prog)


def undrain(argv: list[str], prog: str) -> int:
    return _drain_verb("undrain", argv, prog)
