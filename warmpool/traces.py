"""Request traces to replay: when each request arrived, and how many tokens it read and wrote.

Two CSV formats, told apart by the first line that is not blank or a ``#`` comment:

- **azure** — the public Azure LLM inference traces (github.com/Azure/AzurePublicDataset: the 2023 Splitwise traces,
  an hour each, and the 2024 ones, a week each): a header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (or none, when
  the first row starts with a date) and rows like ``2023-11-16 18:15:46.6805900,4808,10``. Timestamps are read by
  numpy a block of rows at a time (no datetime object per row; the 7 fractional digits are kept to the nanosecond).
- **plain** — ``t_s[,model][,tokens]``: seconds from the trace start, an optional model name, optional generated
  tokens. An optional header names the columns (``t_s,model,tokens``, ``t_s,tokens``, ...); without one, a row of two
  fields reads the second as tokens when it is all digits, else as a model (name a digits-only model in a header).
  Empty fields are allowed for the model and the tokens.

Blank lines and ``#`` comments are skipped in both. Rows out of time order are sorted (stably) and counted in
`Trace.reordered`; the Azure traces are sorted already. A row that cannot be read is a `BadTrace` naming the file,
the line, what was wrong and what was expected; a trace of no requests is one too.

Pure: this module reads the one file it is given and imports nothing but the standard library, numpy and the wire
contract (for the model name pattern); `simulate` and `gateway` both replay with it.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TextIO, TypeVar

import numpy as np
import numpy.typing as npt

from warmpool import protocol
from warmpool.errors import PulsescaleError

__all__ = [
    "AZURE_HEADER",
    "DECODE_TOKENS_PER_S",
    "DEFAULT_GENERATED_TOKENS",
    "MIN_SERVICE_S",
    "PREFILL_TOKENS_PER_S",
    "BadTrace",
    "Trace",
    "read_trace",
]

DECODE_TOKENS_PER_S: Final = 50.0
"""Generated tokens per second of one sequence: decoding is memory-bound, tens of tokens/s per stream for a
7B-70B model at a moderate batch on one GPU; 50 is the middle of that range."""
PREFILL_TOKENS_PER_S: Final = 5000.0
"""Context (prompt) tokens per second of one sequence: prefill is compute-bound and runs thousands of tokens/s, so
a few thousand context tokens add about a second, not tens."""
DEFAULT_GENERATED_TOKENS: Final = 128
"""Generated tokens assumed for a request whose trace gives none: of the order of a short chat answer."""
MIN_SERVICE_S: Final = 0.05
"""No request is free: one scheduling step, the first token and the network cost tens of milliseconds."""

AZURE_HEADER: Final = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_PLAIN_NAMES: Final = {"t_s": "t_s", "t": "t_s", "model": "model", "tokens": "tokens", "generated_tokens": "tokens"}
_PLAIN_EXPECTED: Final = "t_s[,model][,tokens]: seconds from the trace start, a model name, generated tokens"
_AZURE_EXPECTED: Final = "TIMESTAMP,ContextTokens,GeneratedTokens, e.g. 2023-11-16 18:15:46.6805900,4808,10"
_DATE_PREFIX: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_DIGITS: Final = re.compile(r"[0-9]+")
_G = TypeVar("_G", bound=np.generic)
_CHUNK_CHARS = 1 << 22
"""Characters read (and parsed as one numpy block) at a time: ~100k Azure rows; bounds memory on week-long traces."""


class BadTrace(PulsescaleError):
    """A trace file that cannot be replayed: ``trace FILE line N: what was wrong; what was expected``."""

    code = "bad_trace"

    def __init__(self, source: str, line: int | None, problem: str) -> None:
        self.source = source
        self.line = line
        self.problem = problem
        where = f"trace {source}" if line is None else f"trace {source} line {line}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests in arrival order. The arrays are read-only; a missing token count is -1."""

    t_s: npt.NDArray[np.float64]
    """Arrival offsets in seconds from the trace's first request (0.0), ascending, already divided by `speed`. A
    `for_model` trace keeps the offsets of the whole trace, so the models' traces line up: its first may be > 0."""
    generated_tokens: npt.NDArray[np.int64]
    context_tokens: npt.NDArray[np.int64]
    models: tuple[str | None, ...] | None
    """Per request, when the trace names models (plain traces); None when it names none (Azure traces)."""
    format: Literal["azure", "plain"]
    source: str
    """The path as given."""
    speed: float
    reordered: int = 0
    """Rows that came earlier in the file than a row with a later time, before sorting (0 for a sorted trace)."""

    @property
    def duration_s(self) -> float:
        """The last arrival offset: 0 for one request, or none."""
        return float(self.t_s[-1]) if len(self.t_s) else 0.0

    def __len__(self) -> int:
        return len(self.t_s)

    def service_s(
        self,
        *,
        decode_tokens_per_s: float = DECODE_TOKENS_PER_S,
        prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S,
        default_generated: int = DEFAULT_GENERATED_TOKENS,
        default_context: int = 0,
    ) -> npt.NDArray[np.float64]:
        """Per request: context / prefill rate + generated / decode rate, never below `MIN_SERVICE_S`. A request
        without generated tokens gets `default_generated`; one without context tokens `default_context` (0: a
        plain trace's prompts cost nothing beyond the floor)."""
        for name, rate in (
            ("decode_tokens_per_s", decode_tokens_per_s),
            ("prefill_tokens_per_s", prefill_tokens_per_s),
        ):
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"{name} must be finite and > 0, not {rate}")
        if default_generated < 0 or default_context < 0:
            raise ValueError("default token counts must be >= 0")
        gen = np.where(self.generated_tokens < 0, default_generated, self.generated_tokens)
        ctx = np.where(self.context_tokens < 0, default_context, self.context_tokens)
        out: npt.NDArray[np.float64] = np.maximum(ctx / prefill_tokens_per_s + gen / decode_tokens_per_s, MIN_SERVICE_S)
        return out

    def for_model(self, model: str) -> Trace:
        """The requests that name `model` (offsets unchanged), or this whole trace when it names no models. Requests
        that name no model, in a trace where others do, belong to no `for_model` trace."""
        if self.models is None:
            return self
        idx = np.flatnonzero(np.fromiter((m == model for m in self.models), dtype=bool, count=len(self.models)))
        return Trace(
            _frozen(self.t_s[idx]),
            _frozen(self.generated_tokens[idx]),
            _frozen(self.context_tokens[idx]),
            tuple(self.models[i] for i in idx),
            self.format,
            self.source,
            self.speed,
        )


def read_trace(path: Path, *, speed: float = 1.0) -> Trace:
    """Read the trace at `path` (either format, module doc), its offsets divided by `speed` (10: ten times faster).
    Raises `BadTrace` for a file that cannot be read or a row that cannot be parsed, ValueError for a bad `speed`."""
    if not (isinstance(speed, int | float) and math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be finite and > 0, not {speed!r}")
    source = str(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            rows = _Reader(source).read(f)
    except UnicodeDecodeError as err:
        raise BadTrace(source, None, f"not UTF-8 text ({err.reason}); expected a CSV file") from None
    except OSError as err:
        raise BadTrace(source, None, f"cannot read it: {err.strerror or err}") from None
    return rows.trace(source, speed)


# --- reading ---------------------------------------------------------------------------------------------------


def _meaningful(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith("#")


def _chunks(f: TextIO) -> Iterator[list[str]]:
    while lines := f.readlines(_CHUNK_CHARS):
        yield lines


@dataclass
class _Rows:
    """What the reader collected, block by block."""

    fmt: Literal["azure", "plain"] | None = None
    header_line: int | None = None
    times: list[npt.NDArray[np.float64]] | None = None
    stamps: list[npt.NDArray[np.datetime64]] | None = None
    context: list[npt.NDArray[np.int64]] | None = None
    generated: list[npt.NDArray[np.int64]] | None = None
    models: list[str | None] | None = None

    def trace(self, source: str, speed: float) -> Trace:
        gen = _concat(self.generated, np.int64)
        if not len(gen):
            raise BadTrace(source, None, f"no requests in it; expected rows of {_PLAIN_EXPECTED}, or {_AZURE_EXPECTED}")
        ctx = _concat(self.context, np.int64)
        if self.fmt == "azure":
            stamps = np.concatenate(self.stamps or [])
            # Nanoseconds since the earliest row: exact integers before the one conversion to float seconds.
            t = (stamps - stamps.min()).astype(np.int64).astype(np.float64) / 1e9
        else:
            t = _concat(self.times, np.float64)
            t = t - t.min()
        models = self.models if self.models is not None and any(m is not None for m in self.models) else None
        reordered = int(np.count_nonzero(np.diff(t) < 0))
        if reordered:
            order = np.argsort(t, kind="stable")
            t, gen, ctx = t[order], gen[order], ctx[order]
            models = [models[i] for i in order] if models is not None else None
        fmt: Literal["azure", "plain"] = self.fmt or "plain"
        return Trace(
            _frozen(t / speed),
            _frozen(gen),
            _frozen(ctx),
            tuple(models) if models is not None else None,
            fmt,
            source,
            float(speed),
            reordered,
        )


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.rows = _Rows()
        self.layout: tuple[str, ...] | None = None
        """The plain columns a header named; None: each row says by its fields."""

    def read(self, f: TextIO) -> _Rows:
        consumed = 0
        for chunk in _chunks(f):
            first = consumed + 1  # the line number of chunk[0]
            consumed += len(chunk)
            start = 0
            if self.rows.fmt is None:
                while start < len(chunk) and not _meaningful(chunk[start]):
                    start += 1
                if start == len(chunk):
                    continue
                if self._detect(chunk[start], first + start):
                    start += 1
            if self.rows.fmt == "azure":
                self._azure(chunk[start:], first + start)
            else:
                self._plain(chunk[start:], first + start)
        return self.rows

    def bad(self, line: int | None, problem: str) -> BadTrace:
        return BadTrace(self.source, line, problem)

    def _detect(self, line: str, no: int) -> bool:
        """Set the format from the first meaningful line; True when that line is a header."""
        fields = [x.strip() for x in line.split(",")]
        if _DATE_PREFIX.match(fields[0]):
            self.rows.fmt = "azure"
            return False
        if [x.lower() for x in fields] == [x.lower() for x in AZURE_HEADER]:
            self.rows.fmt = "azure"
            return True
        self.rows.fmt = "plain"
        try:
            float(fields[0])
            return False
        except ValueError:
            pass
        names = [_PLAIN_NAMES.get(x.lower()) for x in fields]
        if (
            None in names
            or names[0] != "t_s"
            or len(set(names)) != len(names)
            or names[1:] not in (["model"], ["tokens"], ["model", "tokens"], [])
        ):
            raise self.bad(
                no,
                f"{line.strip()!r} is neither a row nor a header; expected the Azure header "
                f"{','.join(AZURE_HEADER)}, a plain header t_s[,model][,tokens], or a row of {_PLAIN_EXPECTED}",
            )
        self.layout = tuple(n for n in names if n is not None)
        self.rows.header_line = no
        return True

    # --- azure ---

    def _azure(self, lines: Sequence[str], first: int) -> None:
        block = _azure_block(lines)
        if block is None:  # something in this block is not a clean row: read it row by row, for the line number
            block = self._azure_rows(lines, first)
        stamps, ctx, gen = block
        for name in ("stamps", "context", "generated"):
            if getattr(self.rows, name) is None:
                setattr(self.rows, name, [])
        assert self.rows.stamps is not None and self.rows.context is not None and self.rows.generated is not None
        self.rows.stamps.append(stamps)
        self.rows.context.append(ctx)
        self.rows.generated.append(gen)

    def _azure_rows(
        self, lines: Sequence[str], first: int
    ) -> tuple[npt.NDArray[np.datetime64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        stamps: list[np.datetime64] = []
        ctx: list[int] = []
        gen: list[int] = []
        for i, line in enumerate(lines):
            if not _meaningful(line):
                continue
            no = first + i
            fields = [x.strip() for x in line.split(",")]
            if len(fields) != 3:
                raise self.bad(no, f"{len(fields)} fields in {line.strip()!r}; expected 3: {_AZURE_EXPECTED}")
            stamp = _timestamp(fields[0])
            if stamp is None:
                raise self.bad(
                    no,
                    f"TIMESTAMP {fields[0]!r} is not a date and time; expected YYYY-MM-DD HH:MM:SS[.fraction] "
                    "without a time zone, e.g. 2023-11-16 18:15:46.6805900",
                )
            stamps.append(stamp)
            ctx.append(self._count(fields[1], "ContextTokens", no))
            gen.append(self._count(fields[2], "GeneratedTokens", no))
        return (
            np.array(stamps, dtype="datetime64[ns]"),
            np.array(ctx, dtype=np.int64),
            np.array(gen, dtype=np.int64),
        )

    # --- plain ---

    def _plain(self, lines: Sequence[str], first: int) -> None:
        rows = self.rows
        if rows.times is None:
            rows.times, rows.context, rows.generated, rows.models = [], [], [], []
        assert rows.times is not None and rows.context is not None and rows.generated is not None
        assert rows.models is not None
        times: list[float] = []
        gen: list[int] = []
        names_ok: set[str] = set()
        for i, line in enumerate(lines):
            if not _meaningful(line):
                continue
            no = first + i
            fields = [x.strip() for x in line.split(",")]
            columns = self._columns(fields, line, no)
            model: str | None = None
            tokens = -1
            for name, value in zip(columns, fields, strict=True):
                if name == "t_s":
                    times.append(self._seconds(value, no))
                elif name == "model" and value:
                    if value not in names_ok:
                        if not protocol.is_name(value):
                            raise self.bad(
                                no,
                                f"model {value!r} is not a model name; expected lowercase letters, digits, '-' "
                                f"and '_', at most 63 ({protocol.NAME_PATTERN})",
                            )
                        names_ok.add(value)
                    model = value
                elif name == "tokens" and value:
                    tokens = self._count(value, "tokens", no)
            gen.append(tokens)
            rows.models.append(model)
        rows.times.append(np.array(times, dtype=np.float64))
        rows.generated.append(np.array(gen, dtype=np.int64))
        rows.context.append(np.full(len(gen), -1, dtype=np.int64))

    def _columns(self, fields: list[str], line: str, no: int) -> tuple[str, ...]:
        if self.layout is not None:
            if len(fields) > len(self.layout):
                raise self.bad(
                    no,
                    f"{len(fields)} fields in {line.strip()!r}; expected at most {len(self.layout)}: "
                    f"{','.join(self.layout)} (the header on line {self.rows.header_line})",
                )
            return self.layout[: len(fields)]
        if len(fields) == 1:
            return ("t_s",)
        if len(fields) == 2:
            return ("t_s", "tokens") if _DIGITS.fullmatch(fields[1]) else ("t_s", "model")
        if len(fields) == 3:
            return ("t_s", "model", "tokens")
        raise self.bad(no, f"{len(fields)} fields in {line.strip()!r}; expected 1 to 3: {_PLAIN_EXPECTED}")

    def _seconds(self, value: str, no: int) -> float:
        try:
            t = float(value)
        except ValueError:
            raise self.bad(
                no, f"t_s {value!r} is not a number; expected seconds from the trace start, e.g. 12.5"
            ) from None
        if not (math.isfinite(t) and t >= 0):
            raise self.bad(no, f"t_s {value!r} is not a finite number >= 0; expected seconds from the trace start")
        return t

    def _count(self, value: str, name: str, no: int) -> int:
        try:
            n = int(value)
        except ValueError:
            raise self.bad(no, f"{name} {value!r} is not a whole number; expected a token count >= 0") from None
        if n < 0:
            raise self.bad(no, f"{name} {value!r} is negative; expected a token count >= 0")
        return n


def _timestamp(text: str) -> np.datetime64 | None:
    """One Azure timestamp, as numpy reads it (the block path reads the same way), or None."""
    if not _DATE_PREFIX.match(text):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a time zone suffix: numpy warns and drops it; refuse it instead
            stamp = np.datetime64(text, "ns")
    except (ValueError, Warning):
        return None
    return None if np.isnat(stamp) else stamp


def _azure_block(
    lines: Sequence[str],
) -> tuple[npt.NDArray[np.datetime64], npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """A block of clean Azure rows (three fields each, no blank or comment lines) parsed at once, or None when
    anything in it is not clean; the row-by-row path then reads the block and names the bad line. Whatever this
    accepts, the row path accepts with the same values: a misaligned row puts a timestamp where a count belongs,
    and `int` refuses it."""
    n = len(lines)
    if n == 0:
        return np.array([], dtype="datetime64[ns]"), np.array([], np.int64), np.array([], np.int64)
    text = "".join(lines)
    fields = text.replace("\n", ",").split(",")
    if text.endswith("\n"):
        fields.pop()
    if len(fields) != 3 * n:
        return None
    try:
        ctx = np.fromiter(map(int, fields[1::3]), dtype=np.int64, count=n)
        gen = np.fromiter(map(int, fields[2::3]), dtype=np.int64, count=n)
    except ValueError:
        return None
    if (ctx < 0).any() or (gen < 0).any():
        return None
    texts = np.array(fields[0::3])
    width = texts.dtype.itemsize // 4
    if width < 10:
        return None
    # The date prefix (YYYY-MM-DD) checked on the code points, as `_DATE_PREFIX` does on one string: numpy alone
    # would also take "now", "today" and "NaT".
    codes = texts.view(np.uint32).reshape(n, width)[:, :10]
    digits = codes[:, [0, 1, 2, 3, 5, 6, 8, 9]]
    if not (((digits >= ord("0")) & (digits <= ord("9"))).all() and (codes[:, [4, 7]] == ord("-")).all()):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stamps = texts.astype("datetime64[ns]")
    except (ValueError, Warning):
        return None
    if np.isnat(stamps).any():
        return None
    return stamps, ctx, gen


def _concat(parts: list[npt.NDArray[_G]] | None, dtype: type[_G]) -> npt.NDArray[_G]:
    return np.concatenate(parts) if parts else np.array([], dtype=dtype)


def _frozen(a: npt.NDArray[_G]) -> npt.NDArray[_G]:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a
