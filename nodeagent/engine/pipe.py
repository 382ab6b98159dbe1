"""The agent <-> zygote pipe: what the two processes say to each other, as typed messages.

One JSON object per line each way. The agent writes *commands* to the zygote's stdin, tagged by ``cmd``
(`Command`: `Start`, `Stop`, `Exit`); the zygote and its engine child write *events* to the zygote's event
descriptor, tagged by ``ev`` (`Event`: `Armed`, `Forked`, `Serving`, `Failed`, `Exited`, `Error`). Each side decodes
what it reads with a msgspec decoder for its union (`decode_command`, `decode_event`): a line that is not JSON, names
no known kind, or lacks a field its kind needs is a `BadMessage` saying what was wrong, which the reader reports
the way it reports any bad line (the zygote answers with an `Error` event, the agent logs it) instead of failing on
a missing key later. Fields a reader does not know are ignored, so either side may say more than the other reads.

An event line stays well under ``PIPE_BUF`` (4096 bytes), so the zygote's and its child's lines never interleave:
every field is a number or a short string, and the free-text ones (`Failed.reason`, `Error.reason`) are what the
zygote already bounded.

This module runs inside the engine process (the zygote imports it before it forks): msgspec only, no NATS, HTTP
client, metrics or registry (the import contract of `nodeagent.engine`).
"""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec

__all__ = [
    "Armed",
    "BadMessage",
    "Command",
    "Error",
    "Event",
    "Exit",
    "Exited",
    "Failed",
    "Forked",
    "Serving",
    "Start",
    "Stop",
    "decode_command",
    "decode_event",
    "encode",
]

_T = TypeVar("_T")

DEFAULT_GRACE_S: Final = 1.0
"""`Stop.grace_s` when the command does not say."""


class BadMessage(ValueError):
    """A line on the pipe that is not a message of the kind expected there: the text quotes the line (its first 200
    bytes) and says what was wrong, `why` says it alone."""

    def __init__(self, what: str, line: bytes, why: str) -> None:
        self.line = bytes(line[:200])
        self.why = why
        super().__init__(f"bad {what} {self.line!r}: {why}")


# --- commands: agent -> zygote (stdin) -------------------------------------------------------------------------------


class Start(msgspec.Struct, frozen=True, tag_field="cmd", tag="start"):
    """Fork a child that loads the staged weights, builds the engine, binds ``host:port`` (0 = any free port) and
    serves; it reports `Serving` (or `Failed`) itself."""

    port: int = 0


class Stop(msgspec.Struct, frozen=True, tag_field="cmd", tag="stop"):
    """SIGTERM the child, SIGKILL it after `grace_s`; the zygote stays armed and answers with `Exited`."""

    grace_s: float = DEFAULT_GRACE_S


class Exit(msgspec.Struct, frozen=True, tag_field="cmd", tag="exit"):
    """Kill the child and exit (end of stdin means the same: the agent is gone)."""


Command = Start | Stop | Exit


# --- events: zygote and engine child -> agent (the zygote's event descriptor) ----------------------------------------


class Armed(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="ev", tag="armed"):
    """The zygote imported everything, checked the weights' descriptors and froze its heap: it can fork."""

    pid: int
    prepare_ms: float = 0.0
    loader_note: str | None = None


class Forked(msgspec.Struct, frozen=True, tag_field="ev", tag="forked"):
    """The zygote forked the engine process `pid` (a `Start`)."""

    pid: int


class Serving(msgspec.Struct, frozen=True, tag_field="ev", tag="serving"):
    """The engine process `pid` loaded `bytes` of weights (`mode`: the loader's) and listens on `port`."""

    pid: int
    port: int
    load_ms: float
    boot_ms: float
    bytes: int
    mode: str


class Failed(msgspec.Struct, frozen=True, tag_field="ev", tag="failed"):
    """The engine process `pid` could not come up; `stage` (``load``, ``engine``) says where."""

    pid: int
    reason: str
    stage: str = "engine"


class Exited(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="ev", tag="exited"):
    """The engine process `pid` is gone (None: a `Stop` found none running); `requested` by a `Stop` or `Exit`,
    or on its own. `signal` (its name) when it was killed, else its exit `code`."""

    pid: int | None
    requested: bool
    code: int | None = None
    signal: str | None = None

    def describe(self) -> str:
        """How it ended, for a reason: ``was killed by SIGKILL``, ``exited with code 1``."""
        if self.signal:
            return f"was killed by {self.signal}"
        return f"exited with code {self.code}"


class Error(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="ev", tag="error"):
    """The zygote refused a command, or (`fatal`) could not arm and exits."""

    reason: str
    fatal: bool = False


Event = Armed | Forked | Serving | Failed | Exited | Error

_encoder: Final = msgspec.json.Encoder()
_commands: Final = msgspec.json.Decoder(Command)
_events: Final = msgspec.json.Decoder(Event)


def encode(msg: Command | Event) -> bytes:
    """One line of the pipe: `msg` as compact JSON, its tag included, and a newline."""
    return _encoder.encode(msg) + b"\n"


def decode_command(line: bytes) -> Command:
    """A command line from the agent; raises `BadMessage` when it is not one."""
    return _decode(_commands, line, "command")


def decode_event(line: bytes) -> Event:
    """An event line from the zygote or its child; raises `BadMessage` when it is not one."""
    return _decode(_events, line, "event")


def _decode(decoder: msgspec.json.Decoder[_T], line: bytes, what: str) -> _T:
    try:
        return decoder.decode(line)
    except msgspec.DecodeError as err:  # ValidationError included: wrong kind, missing or mistyped field
        raise BadMessage(what, line, str(err)) from None
