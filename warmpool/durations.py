"""Durations and times as every pulsescale command reads and prints them.

One parser for every duration argument (``scale --for``, ``--timeout``, ``sample --every``, the gateway's and the
agent's timeouts): ``500ms``, ``90s``, ``2m``, ``1.5h``, ``1h30m``, ``1h30m15s`` and plain seconds (``600``,
``0.25``), so a flag that used to take seconds keeps working. Units are Go's (`time.ParseDuration`, which kubectl
and KEDA users type) without ``us``/``ns`` (nothing here is that short) and without days (Go has none either: a
``1d`` is refused with the hours to write instead).

And the two ways a time is printed: `rfc3339` (UTC, ``2026-12-03T07:41:05Z``, what ``-o json|yaml`` and
``describe`` show, as the Kubernetes API does) and `age` (``5m``, ``2h3m``, ``3d``: kubectl's table ages, exactly its
``duration.HumanDuration`` rounding).

It lives in warmpool because the node agent and the gateway parse durations too and may not import the
autoscaler (the import-linter contracts). Pure: no I/O.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Callable
from typing import Final

__all__ = [
    "DurationError",
    "age",
    "dashed_values",
    "duration_arg",
    "format_duration",
    "parse_duration",
    "rfc3339",
]

EXAMPLES: Final = "500ms, 90s, 2m, 1.5h, 1h30m or plain seconds (600)"

_UNIT_S: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_ORDER: Final = ("h", "m", "s", "ms")
# [0-9], not \d: in a str pattern \d matches every script's digits, and float() reads them ("\u0663" as 3).
_PART: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+)(ms|h|m|s)")
_PLAIN: Final = re.compile(r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+")


class DurationError(ValueError):
    """A duration argument that cannot be read; the message gives the text, what is wrong and examples.

    A `ValueError`, so argparse's ``type=`` turns it into a usage error with the flag's name in front."""

    code = "bad_duration"


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """``500ms`` → 0.5, ``1.5h`` → 5400, ``1h30m`` → 5400, ``600`` → 600 (plain numbers are seconds).

    Units go from the largest down, each at most once (``30m1h`` is refused: it is a typo more often than not).
    Negative, infinite and (unless `allow_zero`) zero durations are refused, and so are those under half a
    millisecond: they print as ``0ms`` and act as no time at all.
    """
    raw = text.strip()
    seconds = float(raw) if _PLAIN.fullmatch(raw) else _parse_units(text, raw)
    if not math.isfinite(seconds):
        raise DurationError(f"{text!r} is too long a duration")
    if seconds <= 0 and not allow_zero:
        raise DurationError(f"{text!r} is no time at all; give a duration > 0 such as {EXAMPLES}")
    if seconds > 0 and round(seconds * 1000) == 0 and not allow_zero:
        raise DurationError(f"{text!r} rounds to 0ms, no time at all; the shortest duration is 1ms")
    return seconds


def _parse_units(text: str, raw: str) -> float:
    pos, seconds, last = 0, 0.0, -1
    for m in _PART.finditer(raw):
        rank = _ORDER.index(m[2])
        if m.start() != pos or rank <= last:
            break
        seconds += float(m[1]) * _UNIT_S[m[2]]
        pos, last = m.end(), rank
    else:
        if pos == len(raw) and raw:
            return seconds
    hint = ""
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?d", raw):
        hint = f" (days are not a unit: write {float(raw[:-1]) * 24:g}h)"
    elif raw.startswith("-"):
        hint = " (a duration cannot be negative)"
    raise DurationError(f"{text!r} is not a duration such as {EXAMPLES}{hint}")


def duration_arg(*, allow_zero: bool = False, most_s: float | None = None) -> Callable[[str], float]:
    """An argparse ``type=`` that reads a duration; `most_s` bounds it (the message names the bound)."""

    def duration(text: str) -> float:
        try:
            seconds = parse_duration(text, allow_zero=allow_zero)
        except DurationError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if most_s is not None and seconds > most_s:
            raise argparse.ArgumentTypeError(f"{text!r} is longer than the most allowed, {format_duration(most_s)}")
        return seconds

    return duration


_DASHED_VALUE: Final = re.compile(r"^-[0-9.]")


def dashed_values(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let `parser` read ``--for -5s`` as the flag's value (and refuse it as a negative duration) rather than fail
    with "expected one argument": argparse takes any word that starts with a dash and is not a plain negative
    number for an option. Only for parsers with no option spelled like a number (none has one)."""
    parser._negative_number_matcher = _DASHED_VALUE  # argparse has no public switch for this
    return parser


def format_duration(seconds: float) -> str:
    """Seconds → ``1h30m``, ``9m12s``, ``45s``, ``500ms`` (what `parse_duration` reads back). Whole seconds from a
    minute up; under a second, milliseconds."""
    if 0 < seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if 1 <= seconds < 60 and seconds != int(seconds):
        return f"{seconds:.3g}s"
    total = max(0, round(seconds))
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    out = (f"{h}h" if h else "") + (f"{m}m" if m else "") + (f"{s}s" if s and not h else "")
    return out or "0s"


def age(seconds: float) -> str:
    """kubectl's ages (``duration.HumanDuration``): ``45s``, ``5m30s`` under 10 minutes, ``95m`` under 3 hours,
    ``5h20m`` under 8 hours, ``30h`` under 2 days, ``3d4h`` under 8 days, ``40d``, then years."""
    if seconds < -1:
        return "<invalid>"  # a clock ahead of ours: kubectl says so too
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years = days // 365
    if years < 8:
        return f"{years}y{days % 365}d" if days % 365 else f"{years}y"
    return f"{years}y"


def rfc3339(ts: float | None) -> str | None:
    """Unix seconds → ``2026-12-03T07:41:05Z`` (UTC, whole seconds, as Kubernetes prints times); None stays None."""
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
