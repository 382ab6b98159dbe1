"""The on-call client's core: how a command reaches the autoscaler, and how a command ends.

Every on-call command (`oncall.verbs`, `oncall.get`, `oncall.describe`) sends one or more commands of the
contract (`protocol.ScaleCommand`, `StatusCommand`, ...) on ``pulse.cmd.<verb>`` (`request`) and reads their
typed replies. A command gets a fresh ``id`` and ``expires_at = now + --timeout``: once the CLI has given up
waiting, the autoscaler will not apply it either (nats-py may deliver a buffered request late, after a
reconnect). Here too: the options every such command shares (`parser`), the argument types of their flags, and
`run` (send one command, print its reply) and `run_reads` (several reads on one connection).

Exit codes: 0 done; 1 the autoscaler refused (``<prog>: <code>: <message>``), or NATS is unreachable, refused
our credentials or denied a permission (``<prog>: refused: permission denied on <subject> ...``; those are
`NatsUnavailable`, printed by the dispatcher); 2 usage; 3 no autoscaler is answering (NATS ``NoResponders``:
nobody subscribes, which is not the same as slow); 4 the autoscaler did not answer in time (it may or may not have
applied the command; ``pulsescale status`` says).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client

from warmpool import connect as nats_connect
from warmpool import durations, protocol
from warmpool import output as out
from warmpool.errors import BadMessage, PermissionDenied

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXIT_NO_RESPONDERS",
    "EXIT_REFUSED",
    "EXIT_TIMEOUT",
    "Build",
    "CommandFailed",
    "bounded_duration",
    "default_by",
    "format_duration",
    "name_arg",
    "parse_duration",
    "parser",
    "positive_int_arg",
    "replicas_arg",
    "request",
    "run",
    "run_reads",
]

EXIT_REFUSED: Final = 1
EXIT_NO_RESPONDERS: Final = 3
EXIT_TIMEOUT: Final = 4

DEFAULT_TIMEOUT_S: Final = 5.0
"""How long a verb waits for the autoscaler; also the request's lifetime (`expires_at`)."""

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


def bounded_duration(text: str, limit_s: float, what: str, instead: str) -> float:
    """A duration flag of at most `limit_s`; over it, the refusal says the bound and what to do `instead`."""
    seconds = _duration_arg(text)
    if seconds > limit_s:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than {what} ({format_duration(limit_s)}); {instead}")
    return seconds


# ASCII digits only: `str.isdigit` and `int` also read other scripts' digits ("\u0663" as 3), a count that one
# terminal shows differently from another; kubectl and KEDA (Go's strconv) read ASCII digits only.
_COUNT: Final = re.compile(r"[0-9]+")


def replicas_arg(text: str) -> int:
    if not _COUNT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a replica count (a whole number >= 0)")
    return int(text)


def positive_int_arg(text: str) -> int:
    if not _COUNT.fullmatch(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def name_arg(kind: str) -> Callable[[str], str]:
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
    prog: str, description: str, *, output_extra: Sequence[str] = (), by: bool = True, templates: bool = False
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
    out.add_output_argument(p, extra=output_extra, templates=templates)
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


def run(
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


def _fields(reply: protocol.CommandReply) -> dict[str, Any]:
    """A reply as --json prints it: its own fields, without the envelope (``v``, ``ok``, ``error``, ``reason``)."""
    return {k: v for k, v in msgspec.to_builtins(reply).items() if k not in ("v", "ok", "error", "reason")}


def run_reads(
    prog: str,
    args: argparse.Namespace,
    name: str,
    work: Callable[[Client], Any],
    *,
    refused: Callable[[PermissionDenied], bool] | None = None,
) -> int:
    """Run `work` (reads that may send several commands: `get`, `describe`) on one NATS connection; a
    `CommandFailed` is printed and its code returned. Ctrl-C ends it with 0: that is how ``get -w`` stops.

    A permission the server refuses ends the work at once (`connect.run_client`). `refused(err)` may take such a
    refusal of a read the work can do without: it says so (stderr) and changes what `work` reads, returns True, and
    `work` runs once more on a fresh connection; any other refusal leaves as `PermissionDenied` (exit 1)."""
    opts = nats_connect.options_from_args(args, name=name)
    try:
        try:
            return int(asyncio.run(nats_connect.run_client(opts, work)))
        except PermissionDenied as err:
            if refused is None or not refused(err):
                raise
        return int(asyncio.run(nats_connect.run_client(opts, work)))
    except CommandFailed as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 0  # -w ends with Ctrl-C: that is how it is meant to stop
