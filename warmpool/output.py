"""How commands print: kubectl-like tables and ``-o json|yaml`` (``--json``) for machines.

Every command that prints results takes ``-o/--output`` (`add_output_argument`): ``json`` and ``yaml`` print the
result's full object on stdout and nothing else there (progress and warnings go to stderr), so ``| jq`` and
``| pulsescale apply -f -`` work; ``--json`` is ``-o json``. ``wide`` and ``name`` are offered by the commands that
list resources (``get``). Tables are kubectl's: upper-case headers, columns left-aligned three spaces apart, no
colour (nothing here colours, so a pipe or a log gets plain text).

Times in ``-o json|yaml`` follow one rule (`TIMES_RULE`, in the --help of the commands that print them): a wire
reply or record keeps the wire's Unix seconds, which scripts compare and subtract; a Kubernetes object (a
ScaledObject manifest) has RFC 3339, as the Kubernetes API prints it.

It lives in warmpool because the node agent's and the gateway's commands print too and may not import the
autoscaler (the import-linter contracts). Pure: no I/O beyond returning strings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Final, TextIO

import msgspec
import yaml

__all__ = [
    "MACHINE_FORMATS",
    "TIMES_RULE",
    "add_output_argument",
    "dump",
    "finite",
    "machine",
    "progress",
    "replicas_text",
    "table",
]

MACHINE_FORMATS: Final = ("json", "yaml")
TIMES_RULE: Final = (
    "With -o json|yaml, times are Unix seconds (UTC, fractional) as the wire carries them, so scripts compare "
    "them; only a ScaledObject manifest (`get so -o yaml`, `describe so -o yaml`) has RFC 3339, as Kubernetes "
    "objects do."
)
"""The one rule for times in machine output, said in the --help of every command that prints times."""
COLUMN_GAP: Final = "   "
"""kubectl's three spaces between columns."""


def finite(x: float | None) -> float | None:
    """A figure for ``-o json|yaml``: `x`, or None for NaN, infinity or nothing (JSON has no NaN)."""
    return float(x) if x is not None and math.isfinite(x) else None


def progress(fmt: str | None) -> TextIO:
    """Where a command's progress lines go: stdout beside the text report, stderr when stdout carries the
    ``-o json|yaml`` object (`machine`'s answer) and nothing else."""
    return sys.stdout if fmt is None else sys.stderr


def replicas_text(n: int) -> str:
    """``1 replica``, ``0 replicas``, ``3 replicas``: the count as the replies and the CLI print it."""
    return f"{n} replica" if n == 1 else f"{n} replicas"


def add_output_argument(p: argparse.ArgumentParser, *, extra: Sequence[str] = (), templates: bool = False) -> None:
    """``-o/--output FORMAT`` (json, yaml, and `extra` such as wide or name) and ``--json`` (= ``-o json``).
    `templates`: ``jsonpath=TEMPLATE`` too (kubectl's; the command renders it)."""
    choices = (*MACHINE_FORMATS, *extra)
    shown = (*choices, "jsonpath=TEMPLATE") if templates else choices

    def output_format(text: str) -> str:
        if text in choices or (templates and text.startswith("jsonpath=")):
            return text
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(shown)})")

    p.add_argument(
        "-o",
        "--output",
        type=output_format,
        metavar="FORMAT",
        help=f"print {', '.join(shown)} instead of text; json and yaml are the full result, for scripts",
    )
    p.add_argument(
        "--json", dest="output", action="store_const", const="json", help="the same as -o json (for scripts)"
    )


def machine(args: argparse.Namespace) -> str | None:
    """The machine format asked for (``json``/``yaml``), or None for text."""
    out = getattr(args, "output", None)
    return out if out in MACHINE_FORMATS else None


def _builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)  # structs, and structs inside lists and dicts; builtins pass through


def dump(obj: Any, fmt: str) -> str:
    """`obj` (builtins, or msgspec structs) as JSON (indented, key order kept) or YAML (block style), no newline
    at the end; print adds it."""
    data = _builtins(obj)
    if fmt == "json":
        return json.dumps(data, indent=2)
    if fmt == "yaml":
        text: str = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
        return text.rstrip("\n")
    raise ValueError(f"unknown output format {fmt!r}: use one of {', '.join(MACHINE_FORMATS)}")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns left-aligned, three spaces apart, the last one not padded; None prints as ``<none>`` (kubectl)."""
    body = [[("<none>" if c is None else str(c)) for c in row] for row in rows]
    lines = [list(header), *body]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for line in lines:
        cells = [c.ljust(w) for c, w in zip(line[:-1], widths[:-1], strict=True)] + [line[-1]]
        out.append(COLUMN_GAP.join(cells).rstrip())
    return "\n".join(out)
