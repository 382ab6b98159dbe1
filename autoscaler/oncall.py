"""On-call CLI verbs: `pulsescale scale|pause|resume|schedule|status|pool|drain|undrain` and `pulsescale apply -f`.

Each verb sends one command of the contract (`protocol.ScaleCommand`, ...) on ``pulse.cmd.<verb>`` and prints
its typed reply (`protocol.OverrideReply`, `StatusReply`, `PoolReply`, `DrainReply`). A command gets a fresh
``id`` and ``expires_at = now + --timeout``: once the CLI has given up waiting, the autoscaler will not apply it
either (nats-py may deliver a buffered request late, after a reconnect).

Exit codes: 0 done; 1 the autoscaler refused (``<prog>: <code>: <message>``), or NATS is unreachable, refused
our credentials or denied a permission (``<prog>: refused: permission denied on <subject> ...``; those are
`NatsUnavailable`, printed by the dispatcher); 2 usage; 3 no autoscaler is answering (NATS ``NoResponders``:
nobody subscribes, which is not the same as slow); 4 the autoscaler did not answer in time (it may or may not have
applied the command; ``pulsescale status`` says).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import getpass
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Literal, TextIO, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from autoscaler import scaledobject
from autoscaler.commands import MAX_OVERRIDE_S
from autoscaler.commandverbs import replicas_text
from warmpool import buckets, durations, protocol
from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool.errors import BadMessage, NatsUnavailable, PermissionDenied
from warmpool.protocol import (
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
from warmpool.registry import ensure_buckets

__all__ = [
    "EXIT_NO_RESPONDERS",
    "EXIT_REFUSED",
    "EXIT_TIMEOUT",
    "CommandFailed",
    "apply",
    "default_by",
    "drain",
    "format_duration",
    "format_pool",
    "format_replicas",
    "format_shards",
    "format_status",
    "parse_duration",
    "parser",
    "pause",
    "pool",
    "replicas_text",
    "request",
    "resume",
    "scale",
    "schedule",
    "schedule_lines",
    "status",
    "undrain",
]

EXIT_REFUSED: Final = 1
EXIT_NO_RESPONDERS: Final = 3
EXIT_TIMEOUT: Final = 4

DEFAULT_TIMEOUT_S: Final = 5.0
"""How long a verb waits for the autoscaler; also the request's lifetime (`expires_at`)."""
DEFAULT_FOR: Final = "1h"
"""How long `scale` holds a model without --for: an incident's length; a forgotten override lapses by itself."""

# --- durations (one parser for every command: warmpool.durations) -------------------------------------------

parse_duration = durations.parse_duration
format_duration = durations.format_duration


def _duration_arg(text: str) -> float:
    return durations.duration_arg()(text)


def _timeout_arg(text: str) -> float:
    """--timeout is also the request's lifetime: the autoscaler refuses one that expires more than
    `protocol.MAX_REQUEST_TTL_S` ahead (``too_late``), so a longer one is a usage error here, named."""
    seconds = _duration_arg(text)
    if seconds > protocol.MAX_REQUEST_TTL_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than a request may live ({format_duration(protocol.MAX_REQUEST_TTL_S)}, the "
            "autoscaler refuses longer ones); give a shorter --timeout"
        )
    return seconds


def _bounded_duration(text: str, limit_s: float, what: str, instead: str) -> float:
    """A duration flag of at most `limit_s`; over it, the refusal says the bound and what to do `instead`."""
    seconds = _duration_arg(text)
    if seconds > limit_s:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than {what} ({format_duration(limit_s)}); {instead}")
    return seconds


def _override_duration_arg(text: str) -> float:
    return _bounded_duration(
        text, MAX_OVERRIDE_S, "an override may last", "scale again when it lapses, or use `pause`, which holds until "
        "`resume`"
    )  # fmt: skip


# ASCII digits only: `str.isdigit` and `int` also read other scripts' digits ("\u0663" as 3), a count that one
# terminal shows differently from another; kubectl and KEDA (Go's strconv) read ASCII digits only.
_COUNT: Final = re.compile(r"[0-9]+")


def _replicas_arg(text: str) -> int:
    if not _COUNT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a replica count (a whole number >= 0)")
    return int(text)


def _positive_int_arg(text: str) -> int:
    if not _COUNT.fullmatch(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def _name_arg(kind: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if not protocol.is_name(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {kind} name (lowercase letters, digits, '-' and '_'; no dots)"
            )
        return text

    check.__name__ = kind  # argparse names the type in its messages
    return check


# --- sending a command -----------------------------------------------------------------------------------------


def default_by(env: dict[str, str] | None = None) -> str:
    """Who is acting: ``$PULSESCALE_USER``, else ``user@host``."""
    env = dict(os.environ) if env is None else env
    if env.get("PULSESCALE_USER"):
        return env["PULSESCALE_USER"][:128]
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:128]


def parser(
    prog: str, description: str, *, output_extra: Sequence[str] = (), by: bool = True
) -> argparse.ArgumentParser:
    """The options every command sent to the autoscaler shares: --timeout, --by, -o/--json, the NATS flags.
    `by` False hides --by (a read-only command has no audit trail to write; still accepted, and still sent)."""
    p = durations.dashed_values(argparse.ArgumentParser(prog=prog, description=description, epilog=out.TIMES_RULE))
    p.add_argument(
        "--timeout",
        type=_timeout_arg,
        default=DEFAULT_TIMEOUT_S,
        metavar="DURATION",
        help=f"wait this long for the autoscaler (5s, 500ms, plain seconds); the request expires then too "
        f"[{DEFAULT_TIMEOUT_S:g}s]",
    )
    p.add_argument(
        "--by",
        help="who is acting, for the audit trail [$PULSESCALE_USER or user@host]" if by else argparse.SUPPRESS,
    )
    out.add_output_argument(p, extra=output_extra)
    nats_connect.add_nats_arguments(p)
    return p


class CommandFailed(Exception):
    """A command the autoscaler refused or did not answer; `code` is the exit code (`EXIT_REFUSED`, ...)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


R = TypeVar("R", bound=protocol.CommandReply)
Build = Callable[..., protocol.Command]
"""Makes the verb's command from its envelope (``id``, ``expires_at``, ``by``), at the moment it is sent."""


async def request(nc: Client, verb: str, build: Build, reply_type: type[R], args: argparse.Namespace) -> R:
    subject = protocol.cmd_subject(verb)
    command = build(id=uuid.uuid4().hex, expires_at=time.time() + args.timeout, by=args.by or default_by())
    try:
        msg = await nc.request(subject, protocol.encode(command), timeout=args.timeout)
    except nats.errors.NoRespondersError:
        raise CommandFailed(
            f"no autoscaler is answering on {subject} (is `pulsescale autoscaler` running and connected to the "
            "same NATS? any replica that holds a shard answers and hands the command to the model's owner; while "
            "none holds one, as during a failover, retry in a few seconds)",
            EXIT_NO_RESPONDERS,
        ) from None
    except nats.errors.TimeoutError:
        raise CommandFailed(
            f"the autoscaler did not answer on {subject} within {args.timeout:g} s; the request has expired, so it "
            "will not be applied late, but it may have been applied already: check `pulsescale status`",
            EXIT_TIMEOUT,
        ) from None
    except nats.errors.Error as err:
        raise CommandFailed(f"NATS failed during the request on {subject}: {err}", EXIT_REFUSED) from None
    try:
        reply = protocol.decode(msg.data, reply_type)
    except BadMessage as err:
        raise CommandFailed(f"the autoscaler sent a reply this CLI cannot read ({err})", EXIT_REFUSED) from None
    if not reply.ok:
        code, message = (reply.error.code, reply.error.message) if reply.error else ("internal", "no error given")
        raise CommandFailed(f"{code}: {message}", EXIT_REFUSED)
    return reply


def _run(
    prog: str,
    args: argparse.Namespace,
    verb: str,
    build: Build,
    reply_type: type[R],
    show: Callable[[R], None],
    machine_view: Callable[[R], Any] | None = None,
) -> int:
    """Send one command and show its reply: `show` for text, or with ``-o json|yaml`` the reply's fields
    (`machine_view` picks them; the reply without its envelope by default). A NATS failure (unreachable,
    refused) is left to the dispatcher."""
    opts = nats_connect.options_from_args(args, name=f"pulsescale-{verb}")
    try:
        reply = asyncio.run(nats_connect.run_client(opts, lambda nc: request(nc, verb, build, reply_type, args)))
    except CommandFailed as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return err.code
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(machine_view(reply) if machine_view is not None else _fields(reply), fmt))
    else:
        show(reply)
    return 0


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


def _fields(reply: protocol.CommandReply) -> dict[str, Any]:
    """A reply as --json prints it: its own fields, without the envelope (``v``, ``ok``, ``error``, ``reason``)."""
    return {k: v for k, v in msgspec.to_builtins(reply).items() if k not in ("v", "ok", "error", "reason")}


# --- the verbs -----------------------------------------------------------------------------------------------------


def scale(argv: list[str], prog: str) -> int:
    p = parser(prog, "Hold a model at N replicas for a while; the policy takes over again when it lapses.")
    p.add_argument("model", type=_name_arg("model"))
    p.add_argument("--replicas", type=_replicas_arg, required=True, metavar="N")
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

    return _run(prog, args, "scale", build, OverrideReply, show)


def pause(argv: list[str], prog: str) -> int:
    p = parser(prog, "Stop autoscaling a model, at its current count or at --replicas N, until `resume`.")
    p.add_argument("model", type=_name_arg("model"))
    p.add_argument("--replicas", type=_replicas_arg, metavar="N", help="hold at N replicas [the current count]")
    args = p.parse_args(argv)

    def build(**envelope: Any) -> PauseCommand:
        return PauseCommand(**envelope, model=args.model, replicas=args.replicas)

    def show(_: OverrideReply) -> None:
        at = f"at {replicas_text(args.replicas)}" if args.replicas is not None else "at its current count"
        print(f"{args.model} paused {at}; `pulsescale resume {args.model}` hands it back to the policy")

    return _run(prog, args, "pause", build, OverrideReply, show)


def resume(argv: list[str], prog: str) -> int:
    p = parser(prog, "End a model's override (scale or pause): the policy decides again.")
    p.add_argument("model", type=_name_arg("model"))
    args = p.parse_args(argv)

    def build(**envelope: Any) -> ResumeCommand:
        return ResumeCommand(**envelope, model=args.model)

    return _run(prog, args, "resume", build, OverrideReply, lambda _: print(f"{args.model} is autoscaled again"))


def _schedule_arg(text: str) -> float:
    return _bounded_duration(
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
    p.add_argument("model", type=_name_arg("model"))
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--at", type=_local_time_arg, metavar="LOCAL-TIME", help="start, local time in --tz: 2026-12-24T18:00"
    )
    act.add_argument("--delete", type=_name_arg("schedule"), metavar="NAME", help="delete the on-call schedule NAME")
    act.add_argument("--list", action="store_true", help="list the model's schedules (the default)")
    p.add_argument("--tz", default="UTC", metavar="ZONE", help="IANA zone of --at: Europe/Berlin [UTC]")
    p.add_argument(
        "--for",
        dest="for_s",
        type=_schedule_arg,
        metavar="DURATION",
        help=f"how long the floor holds: 90m, 2h, 36h; at most {format_duration(protocol.MAX_SCHEDULE_S)}",
    )
    p.add_argument("--replicas", type=_replicas_arg, metavar="N", help="the floor: at least N replicas")
    p.add_argument("--name", type=_name_arg("schedule"), help="names the schedule [at-<date>-<time>]")
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

    return _run(prog, args, "schedule", build, ScheduleReply, show)


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
    p.add_argument("model", nargs="?", type=_name_arg("model"))
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

    return _run(prog, args, "status", build, StatusReply, show, machine_view)


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
    p.add_argument("model", nargs="?", type=_name_arg("model"))
    args = p.parse_args(argv)

    def build(**envelope: Any) -> PoolCommand:
        return PoolCommand(**envelope, model=args.model)

    return _run(prog, args, "pool", build, PoolReply, lambda reply: print(format_pool(reply)))


def _drain_verb(verb: Literal["drain", "undrain"], argv: list[str], prog: str) -> int:
    what = (
        "Stop offering a node's slots: idle ones go to draining at once, serving ones when released."
        if verb == "drain"
        else "Offer a drained node's slots again."
    )
    p = parser(prog, what)
    p.add_argument("node", type=_name_arg("node"))
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

    return _run(prog, args, verb, build, DrainReply, show)


def drain(argv: list[str], prog: str) -> int:
    return _drain_verb("drain", argv, prog)


def undrain(argv: list[str], prog: str) -> int:
    return _drain_verb("undrain", argv, prog)


# --- apply -------------------------------------------------------------------------------------------------------


def _read_stdin(stdin: TextIO) -> str:
    try:
        return stdin.read()
    except (OSError, UnicodeDecodeError) as err:
        raise scaledobject.ScaledObjectError("", f"cannot read it: {err}", where="<stdin>") from None


def load_manifests(
    paths: Sequence[str], *, recursive: bool, stdin: TextIO, now: float, max_replicas: int
) -> list[scaledobject.Manifest]:
    """Every ScaledObject of ``-f`` (files, directories, ``-`` for stdin; multi-document streams), all checked
    before any is written; a ``<namespace>.<name>`` defined twice anywhere is refused (the second would win).
    Documents of other kinds (the Deployment and Service beside a ScaledObject) are skipped, one stderr line
    each: kubectl applies them, `apply` writes only ScaledObjects."""
    manifests: list[scaledobject.Manifest] = []
    skipped: list[str] = []
    for path in paths:
        if path == "-":
            text = _read_stdin(stdin)
            manifests += scaledobject.load_documents(
                text, "<stdin>", updated_at=now, max_replicas=max_replicas, skipped=skipped
            )
        else:  # a file or a directory (-R: its subdirectories), read as kubectl apply -f does
            manifests += scaledobject.load_path(
                path, recursive=recursive, updated_at=now, max_replicas=max_replicas, skipped=skipped
            )
        for line in skipped:
            print(line, file=sys.stderr)
        skipped.clear()
    first: dict[str, scaledobject.Manifest] = {}
    models: dict[str, scaledobject.Manifest] = {}
    for m in manifests:
        seen = first.setdefault(m.record.key, m)
        if seen is not m:
            raise scaledobject.ScaledObjectError(
                "metadata.name",
                f"{m.record.key} is also defined by {seen.where}",
                where=m.where,
            )
        # One ScaledObject per model, across every -f too: the autoscaler would serve one and drop the other.
        other = models.setdefault(m.record.spec.model, m)
        if other is not m:
            raise scaledobject.ScaledObjectError(
                "spec.triggers[0].metadata.model",
                f"{m.record.spec.model} is also scaled by {other.record.key} ({other.where}); one ScaledObject per "
                "model: merge the two or give each its own model",
                where=m.where,
            )
    return manifests


DRY_RUN_CONNECT_S: Final = 1.0
"""How long ``apply --dry-run`` waits for NATS to read `pulse_scalers` (the model check) before it checks the
files alone: a dry run is also the offline check of a manifest, and must not hang on a missing server."""


async def _written(nc: Client) -> list[protocol.ScalerRecord]:
    """Every readable record of `pulse_scalers` (none when the bucket does not exist yet)."""
    js = nc.jetstream(timeout=5.0)
    try:
        kv = await js.key_value(protocol.SCALERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return []
    keys = await buckets.list_keys(js, protocol.SCALERS_BUCKET)
    out: list[protocol.ScalerRecord] = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # deleted meanwhile
        if entry.value:
            try:
                out.append(protocol.decode(entry.value, protocol.ScalerRecord))
            except BadMessage:
                continue  # unreadable: the autoscaler serves nothing from it either
    return out


class Applied(msgspec.Struct, kw_only=True):
    """One ScaledObject as `apply -o json|yaml` reports it."""

    key: str
    action: Literal["created", "configured", "unchanged", "valid"]
    """``valid``: --dry-run, nothing written."""
    generation: int
    model: str
    notes: list[str] = []


APPLY_RETRY_S: Final = 10.0
"""How long `apply` asks again while a read or write of `pulse_scalers` finds no responder or times out: the first
write to a stream a fresh cluster just made can find no leader's interest yet (`nats: timeout`, seen on a new
3-server cluster; the cluster tests retry the same first write). A write that found no responder did not land;
one that timed out may have, and writing the same record again is harmless."""

_APPLY_RETRY_EVERY_S: Final = 0.25

_NOT_ANSWERED: Final = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)

T = TypeVar("T")


async def _answered(call: Callable[[], Awaitable[T]], *, deadline: float) -> T:
    """`call()`, asked again every `_APPLY_RETRY_EVERY_S` while it finds no responder or times out, until the
    monotonic `deadline` (then the last error is raised)."""
    while True:
        try:
            return await call()
        except _NOT_ANSWERED:
            if time.monotonic() + _APPLY_RETRY_EVERY_S >= deadline:
                raise
            await asyncio.sleep(_APPLY_RETRY_EVERY_S)


async def _write(nc: Client, manifests: list[scaledobject.Manifest]) -> list[Applied]:
    kv = (await ensure_buckets(nc.jetstream(timeout=5.0), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]
    deadline = time.monotonic() + APPLY_RETRY_S
    # Checked before any write: a model another ScaledObject already scales is refused, all or nothing.
    scaledobject.check_models(manifests, await _answered(lambda: _written(nc), deadline=deadline))
    out: list[Applied] = []
    for m in manifests:
        rec = m.record
        previous = None
        try:
            entry = await _answered(functools.partial(kv.get, rec.key), deadline=deadline)
            if entry.value is not None:
                previous = protocol.decode(entry.value, protocol.ScalerRecord)
        except nats.js.errors.KeyNotFoundError:
            pass
        except BadMessage:
            previous = None  # unreadable: overwrite it
        if previous is not None and scaledobject.same_content(previous, rec):
            out.append(Applied(key=rec.key, action="unchanged", generation=previous.generation, model=rec.spec.model,
                               notes=rec.notes))  # fmt: skip
            continue
        gen = (previous.generation if previous is not None else 0) + 1
        # created_at: the first write's time, kept on every later one (initialCooldownPeriod counts from it).
        created = (previous.created_at if previous is not None else None) or rec.created_at or rec.updated_at
        value = protocol.encode(msgspec.structs.replace(rec, generation=gen, created_at=created))
        await _answered(functools.partial(kv.put, rec.key, value), deadline=deadline)
        action: Literal["created", "configured"] = "configured" if previous else "created"
        out.append(Applied(key=rec.key, action=action, generation=gen, model=rec.spec.model, notes=rec.notes))
    return out


def _summary(rec: protocol.ScalerRecord) -> str:
    s = rec.spec
    paused = ""
    if rec.paused:
        paused = f", paused at {rec.paused_replicas}" if rec.paused_replicas is not None else ", paused"
    if rec.paused_scale_in:
        paused += ", paused scale-in"
    if s.advanced.scale_down_select_policy == "Disabled" and not rec.paused_scale_in:
        paused += ", no scale-in (scaleDown.selectPolicy: Disabled)"
    if rec.paused_scale_out:
        hpa = s.advanced.horizontal_pod_autoscaler_config
        up = hpa.behavior.scale_up if hpa is not None and hpa.behavior is not None else None
        disabled = up is not None and up.select_policy == "Disabled"
        paused += ", paused scale-out (scaleUp.selectPolicy: Disabled)" if disabled else ", paused scale-out"
    return (
        f" (model {s.model}, replicas {s.min_replica_count}..{s.max_replica_count}, "
        f"warm pool {s.warm_pool.size}{paused})"
    )


def apply(argv: list[str], prog: str, *, stdin: TextIO | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"Write ScaledObjects ({scaledobject.API_VERSION}, the YAML the CRD takes) to KV "
        f"{protocol.SCALERS_BUCKET}, for use without Kubernetes; needs the operator's NATS user. Every document of "
        "every file is checked before any is written.",
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE|DIR",
        help="a YAML file (multi-document streams too), a directory of .yaml/.yml/.json files, or '-' for stdin; "
        "repeatable",
    )
    p.add_argument("-R", "--recursive", action="store_true", help="with -f DIR: its subdirectories too")
    p.add_argument("--dry-run", action="store_true", help="check the files and print what would be written")
    p.add_argument(
        "--max-replicas",
        type=_positive_int_arg,
        metavar="N",
        help=f"refuse replica counts over N [$PULSESCALE_MAX_REPLICAS or {scaledobject.DEFAULT_MAX_REPLICAS}]",
    )
    out.add_output_argument(p)
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    now = time.time()
    try:
        limit = args.max_replicas or scaledobject.max_replicas_from_env(os.environ)
        manifests = load_manifests(
            args.filename, recursive=args.recursive, stdin=stdin or sys.stdin, now=now, max_replicas=limit
        )
    except scaledobject.ScaledObjectError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return EXIT_REFUSED
    if args.dry_run:
        # The model check needs pulse_scalers: read it if NATS answers soon, else say it was not done.
        opts = nats_connect.options_from_args(args, name="pulsescale-apply-dry-run")
        opts = dataclasses.replace(opts, connect_deadline_s=min(opts.connect_deadline_s, DRY_RUN_CONNECT_S))
        try:
            written = asyncio.run(nats_connect.run_client(opts, _written))
        except (NatsUnavailable, nats.errors.Error, TimeoutError) as err:
            print(
                f"{prog}: note: {protocol.SCALERS_BUCKET} not read ({err}); the files are checked, not whether "
                "another ScaledObject already scales their models",
                file=sys.stderr,
            )
            written = []
        try:
            scaledobject.check_models(manifests, written)
        except scaledobject.ScaledObjectError as err:
            print(f"{prog}: {err}", file=sys.stderr)
            return EXIT_REFUSED
        results = [
            Applied(key=m.record.key, action="valid", generation=m.record.generation, model=m.record.spec.model,
                    notes=m.record.notes)
            for m in manifests
        ]  # fmt: skip
    else:
        opts = nats_connect.options_from_args(args, name="pulsescale-apply")
        try:
            results = asyncio.run(nats_connect.run_client(opts, lambda nc: _write(nc, manifests)))
        except scaledobject.ScaledObjectError as err:
            print(f"{prog}: {err}", file=sys.stderr)
            return EXIT_REFUSED
        except PermissionDenied as err:
            print(f"{prog}: {err}; writing {protocol.SCALERS_BUCKET} needs the operator's NATS user", file=sys.stderr)
            return EXIT_REFUSED
        except (nats.errors.Error, TimeoutError) as err:
            print(f"{prog}: writing to {protocol.SCALERS_BUCKET} failed: {err}", file=sys.stderr)
            return EXIT_REFUSED
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(results, fmt))
        return 0
    records = {m.record.key: m.record for m in manifests}
    for r in results:
        tail = " (dry run: nothing written)" if r.action == "valid" else ""
        print(f"scaledobject {r.key} {r.action}{_summary(records[r.key])}{tail}")
        for note in r.notes:
            print(f"note: {r.key}: {note}")
    return 0
