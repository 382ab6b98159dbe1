"""An open-loop load generator for the article's pulse: a steady base, a pulse to 300 % of the provisioned capacity
reached within 1 s, held, then back to the base.

Open loop: requests are sent on a schedule fixed before the run (`arrivals`), never waiting for earlier answers, so a
slow or overloaded server gets more outstanding requests, as it would from real users, instead of a politely slower
client (the coordinated-omission trap of closed-loop tools). Arrivals are Poisson (exponential gaps, the default) or
uniform, at the rate the `PulseShape` gives at each instant.

Each request is counted in the second it was sent: sent, 200s, 429s, 504s, other statuses, errors (no HTTP answer),
the latency percentiles of its 200s, and how late it was sent (behind its scheduled time: a generator that cannot
keep up says so); `LoadResult` has the timeline (JSON or CSV) and the totals. From Python::

    result = await run_load("http://127.0.0.1:8080", "tiny", PulseShape.from_capacity(20.0))

and from a shell, ``pulsescale load http://127.0.0.1:8080 --model tiny --capacity-rps 20``. With ``--trace FILE``
the arrivals come from a request trace instead (`gateway.replay`).

`PulseShape`, `arrivals` and `percentile` are pure (time passed in).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, TextIO

import aiohttp

from warmpool import durations, traces

__all__ = [
    "LoadResult",
    "PulseShape",
    "Second",
    "arrivals",
    "main",
    "percentile",
    "print_report",
    "run_load",
    "send_schedule",
]

Phase = Literal["base", "ramp", "pulse", "after", "trace"]
"""Where a second lies in the pulse; "trace" for every second of a trace replay."""
LATE_WARN_S = 0.1
"""Sends this far behind schedule are reported as the generator not keeping up (event-loop jitter is ~1 ms)."""


@dataclass(frozen=True)
class PulseShape:
    """Offered load over time: `base_rps` for `base_s`, a linear ramp over `ramp_s` to `pulse_rps`, held for
    `hold_s`, then `base_rps` again for `after_s`."""

    base_rps: float
    pulse_rps: float
    base_s: float = 10.0
    ramp_s: float = 1.0
    """The article's pulse reaches its peak "within seconds"; 1 s is the issue's bound."""
    hold_s: float = 10.0
    after_s: float = 10.0

    def __post_init__(self) -> None:
        values = (self.base_rps, self.pulse_rps, self.base_s, self.ramp_s, self.hold_s, self.after_s)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"rates and durations must be finite and >= 0: {self}")

    @classmethod
    def from_capacity(
        cls, capacity_rps: float, *, base_pct: float = 50.0, pulse_pct: float = 300.0, **durations: float
    ) -> PulseShape:
        """The article's test: a base at `base_pct` of the provisioned capacity, a pulse to `pulse_pct` of it."""
        return cls(capacity_rps * base_pct / 100, capacity_rps * pulse_pct / 100, **durations)

    @property
    def duration_s(self) -> float:
        return self.base_s + self.ramp_s + self.hold_s + self.after_s

    @property
    def pulse_start_s(self) -> float:
        return self.base_s

    def phase(self, t: float) -> Phase:
        if t < self.base_s:
            return "base"
        if t < self.base_s + self.ramp_s:
            return "ramp"
        if t < self.base_s + self.ramp_s + self.hold_s:
            return "pulse"
        return "after"

    def rate(self, t: float) -> float:
        """Requests per second offered at `t` seconds into the run."""
        phase = self.phase(t)
        if phase == "ramp":
            return self.base_rps + (self.pulse_rps - self.base_rps) * (t - self.base_s) / self.ramp_s
        return self.pulse_rps if phase == "pulse" else self.base_rps


def arrivals(
    shape: PulseShape, *, kind: Literal["poisson", "uniform"] = "poisson", seed: int = 0, step_s: float = 0.001
) -> list[float]:
    """Send times (seconds from the start) for `shape`. The rate is integrated in `step_s` steps; a request is due
    each time the integral passes the next threshold: 1, 2, 3, ... (uniform) or the sums of unit exponential
    gaps (Poisson: a time-changed Poisson process, exact for any rate curve)."""
    rng = random.Random(seed)

    def gap() -> float:
        return rng.expovariate(1.0) if kind == "poisson" else 1.0

    out: list[float] = []
    target = gap() if kind == "poisson" else 0.5  # uniform: the first at half a gap, not at t=0
    area = 0.0
    steps = round(shape.duration_s / step_s)
    for i in range(steps):
        t0 = i * step_s
        r0, r1 = shape.rate(t0), shape.rate(t0 + step_s)
        step_area = (r0 + r1) / 2 * step_s
        while area + step_area >= target:
            # Linear within the step: where the threshold is crossed (the rate is nearly constant over 1 ms).
            frac = (target - area) / step_area if step_area > 0 else 0.0
            out.append(t0 + frac * step_s)
            target += gap()
        area += step_area
    return out


def percentile(sorted_values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class Second:
    """One second of the run, by send time."""

    t: int
    phase: Phase
    offered_rps: float
    sent: int = 0
    ok: int = 0
    rejected_429: int = 0
    timeouts_504: int = 0
    other_status: int = 0
    errors: int = 0
    dropped: int = 0
    """Not sent: `max_outstanding` requests were already waiting for answers (the generator's own limit)."""
    latencies_s: list[float] = field(default_factory=list, repr=False)
    late_s: list[float] = field(default_factory=list, repr=False)
    """Per send: how long after its scheduled time it went out."""

    def row(self) -> dict[str, object]:
        lat = sorted(self.latencies_s)
        out: dict[str, object] = {k: v for k, v in asdict(self).items() if k not in ("latencies_s", "late_s")}
        for p in (50, 95, 99):
            v = percentile(lat, p)
            out[f"p{p}_ms"] = None if v is None else round(v * 1000, 2)
        out["late_max_ms"] = round(max(self.late_s) * 1000, 2) if self.late_s else None
        return out


@dataclass
class LoadResult:
    url: str
    model: str
    """The model asked for; a trace replay's models, comma-separated."""
    shape: PulseShape | None
    """None for a trace replay."""
    arrivals_kind: str
    """poisson, uniform, or trace."""
    seconds: list[Second]
    started_at: float
    """Wall time (Unix s) of t=0, to line the timeline up with other records of the run."""
    trace: dict[str, object] | None = None
    """A trace replay's file, format, speed and requests replayed."""

    def total(self, name: str) -> int:
        return sum(int(getattr(s, name)) for s in self.seconds)

    @property
    def sent(self) -> int:
        return self.total("sent")

    @property
    def ok(self) -> int:
        return self.total("ok")

    @property
    def timeouts(self) -> int:
        return self.total("timeouts_504")

    @property
    def rejected(self) -> int:
        return self.total("rejected_429")

    @property
    def errors(self) -> int:
        return self.total("errors")

    def latency_ms(self, pct: float, phase: Phase | None = None) -> float | None:
        lat = sorted(x for s in self.seconds if phase in (None, s.phase) for x in s.latencies_s)
        v = percentile(lat, pct)
        return None if v is None else round(v * 1000, 2)

    def late_ms(self, pct: float) -> float | None:
        """How far behind schedule sends went out, at percentile `pct` (100: the latest)."""
        v = percentile(sorted(x for s in self.seconds for x in s.late_s), pct)
        return None if v is None else round(v * 1000, 2)

    def summary(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "ok": self.ok,
            "rejected_429": self.rejected,
            "timeouts_504": self.timeouts,
            "other_status": self.total("other_status"),
            "errors": self.errors,
            "dropped": self.total("dropped"),
            "p50_ms": self.latency_ms(50),
            "p95_ms": self.latency_ms(95),
            "p99_ms": self.latency_ms(99),
            "timeouts_504_in_pulse": sum(s.timeouts_504 for s in self.seconds if s.phase in ("ramp", "pulse")),
            "late_p99_ms": self.late_ms(99),
            "late_max_ms": self.late_ms(100),
        }

    def to_json(self) -> str:
        return json.dumps(
            {
                "url": self.url,
                "model": self.model,
                "shape": None if self.shape is None else asdict(self.shape),
                "arrivals": self.arrivals_kind,
                **({"trace": self.trace} if self.trace is not None else {}),
                "started_at": self.started_at,
                "summary": self.summary(),
                "seconds": [s.row() for s in self.seconds],
            },
            indent=2,
        )

    def to_csv(self) -> str:
        buf = io.StringIO()
        rows = [s.row() for s in self.seconds]
        if rows:
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        return buf.getvalue()


async def run_load(
    url: str,
    model: str,
    shape: PulseShape,
    *,
    kind: Literal["poisson", "uniform"] = "poisson",
    seed: int = 0,
    prompt: str = "hello",
    max_tokens: int = 8,
    path: str = "/v1/completions",
    request_timeout_s: float = 120.0,
    max_outstanding: int = 10_000,
    on_second: Callable[[Second], None] | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Send `shape`'s requests to `url` + `path` (open loop, module doc) and count what came back. Returns once
    every request sent has its answer (or `request_timeout_s` passed). `on_second` is called with each second's
    counts once that second's sends are done (its answers may still come); `stop` ends the sending early."""
    times = arrivals(shape, kind=kind, seed=seed)
    seconds = [Second(t, shape.phase(t + 0.5), shape.rate(t + 0.5)) for t in range(math.ceil(shape.duration_s))]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    started_at = await send_schedule(
        url.rstrip("/") + path,
        ((at, body) for at in times),
        seconds,
        request_timeout_s=request_timeout_s,
        max_outstanding=max_outstanding,
        on_second=on_second,
        stop=stop,
    )
    return LoadResult(url, model, shape, kind, seconds, started_at)


async def send_schedule(
    target: str,
    schedule: Iterable[tuple[float, bytes]],
    seconds: list[Second],
    *,
    request_timeout_s: float = 120.0,
    max_outstanding: int = 10_000,
    on_second: Callable[[Second], None] | None = None,
    stop: asyncio.Event | None = None,
) -> float:
    """POST each `(at, body)` of `schedule` (ascending `at`, seconds from the start) to `target` at its time, open
    loop, counting it in `seconds[int(at)]` (the last second for any later); returns the wall time (Unix s) of
    t=0 once every request sent has its answer. Pulse runs and trace replays both send through here."""
    headers = {"Content-Type": "application/json"}
    loop = asyncio.get_running_loop()
    outstanding: set[asyncio.Task[None]] = set()

    async def one(sec: Second, body: bytes, session: aiohttp.ClientSession) -> None:
        t0 = loop.time()
        try:
            async with session.post(target, data=body, headers=headers) as r:
                await r.read()
                status = r.status
        except (aiohttp.ClientError, OSError):
            sec.errors += 1
            return
        if status == 200:
            sec.ok += 1
            sec.latencies_s.append(loop.time() - t0)
        elif status == 429:
            sec.rejected_429 += 1
        elif status == 504:
            sec.timeouts_504 += 1
        else:
            sec.other_status += 1

    connector = aiohttp.TCPConnector(limit=max_outstanding, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    started_at = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t_start = loop.time()
        reported = 0
        for at, body in schedule:
            if stop is not None and stop.is_set():
                break
            delay = t_start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sec = seconds[min(int(at), len(seconds) - 1)]
            while on_second is not None and reported < sec.t:
                on_second(seconds[reported])
                reported += 1
            sec.late_s.append(max(0.0, loop.time() - t_start - at))
            if len(outstanding) >= max_outstanding:
                sec.dropped += 1
                continue
            sec.sent += 1
            task = asyncio.create_task(one(sec, body, session))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        if outstanding:
            await asyncio.wait(set(outstanding))
        while on_second is not None and reported < len(seconds):
            on_second(seconds[reported])
            reported += 1
    return started_at


_duration = durations.duration_arg(allow_zero=True)
"""The time flags read durations (``90s``, ``2m``, plain seconds), as every command does (`warmpool.durations`)."""


def main(argv: list[str], prog: str, out: TextIO = sys.stdout) -> int:
    p = durations.dashed_values(
        argparse.ArgumentParser(
            prog=prog,
            description="Open-loop load against an OpenAI-style endpoint (the gateway): a base rate, a pulse reached "
            "within --ramp-s, held for --hold-s, then the base again. Prints per-second sent/200/429/504/errors and "
            "latency percentiles; --json/--csv write the timeline. With --trace, the arrivals of a request trace "
            "instead (Azure LLM inference CSV, or t_s[,model][,tokens]).",
        )
    )
    p.add_argument("url", help="the gateway, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", help="the model to ask for (with --trace: for the requests whose row names none)")
    p.add_argument("--capacity-rps", type=float, help="provisioned capacity: base and pulse are percentages of it")
    p.add_argument("--base-pct", type=float, default=50.0, help="with --capacity-rps: the base [50]")
    p.add_argument("--pulse-pct", type=float, default=300.0, help="with --capacity-rps: the pulse [300]")
    p.add_argument("--base-rps", type=float, help="the base rate (instead of --capacity-rps)")
    p.add_argument("--pulse-rps", type=float, help="the pulse rate (instead of --capacity-rps)")
    p.add_argument(
        "--base-s", type=_duration, metavar="DURATION", default=10.0, help="seconds at the base before the pulse [10]"
    )
    p.add_argument("--ramp-s", type=_duration, metavar="DURATION", default=1.0, help="seconds to reach the pulse [1]")
    p.add_argument("--hold-s", type=_duration, metavar="DURATION", default=10.0, help="seconds the pulse is held [10]")
    p.add_argument(
        "--after-s", type=_duration, metavar="DURATION", default=10.0, help="seconds at the base after the pulse [10]"
    )
    p.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson", help="[poisson]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="hello")
    p.add_argument(
        "--max-tokens",
        type=int,
        help=f"[8; with --trace, for the requests that give no generated tokens: {traces.DEFAULT_GENERATED_TOKENS}]",
    )
    p.add_argument(
        "--request-timeout-s",
        type=_duration,
        metavar="DURATION",
        default=120.0,
        help="client-side bound per request [120]",
    )
    p.add_argument("--json", metavar="FILE", help="write the timeline and totals as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the per-second timeline as CSV")
    t = p.add_argument_group("trace replay")
    t.add_argument("--trace", metavar="FILE", help="send the requests of this trace, each at its time")
    t.add_argument("--speed", type=float, default=1.0, help="replay this many times faster (10: offsets / 10) [1]")
    t.add_argument("--max-requests", type=int, metavar="N", help="send at most the first N requests [all]")
    t.add_argument(
        "--duration-s", type=_duration, metavar="DURATION", help="send only the first DURATION (after --speed)"
    )
    args = p.parse_args(argv)
    if args.trace is not None:
        return _replay(p, args, out)
    if args.model is None:
        p.error("the following arguments are required: --model (or give --trace)")
    try:
        if args.capacity_rps is not None:
            phases = {k: getattr(args, k) for k in ("base_s", "ramp_s", "hold_s", "after_s")}
            shape = PulseShape.from_capacity(
                args.capacity_rps, base_pct=args.base_pct, pulse_pct=args.pulse_pct, **phases
            )
        elif args.base_rps is not None and args.pulse_rps is not None:
            shape = PulseShape(args.base_rps, args.pulse_rps, args.base_s, args.ramp_s, args.hold_s, args.after_s)
        else:
            p.error("give --capacity-rps, or --base-rps and --pulse-rps")
    except ValueError as err:
        p.error(str(err))

    result = asyncio.run(
        run_load(
            args.url,
            args.model,
            shape,
            kind=args.arrivals,
            seed=args.seed,
            prompt=args.prompt,
            max_tokens=8 if args.max_tokens is None else args.max_tokens,
            request_timeout_s=args.request_timeout_s,
            on_second=_progress,
        )
    )
    print_report(result, out)
    _write_files(result, args)
    return 0


def _progress(s: Second) -> None:
    print(f"t={s.t:>3}s {s.phase:<5} offered {s.offered_rps:6.1f}/s sent {s.sent}", file=sys.stderr, flush=True)


def _replay(p: argparse.ArgumentParser, args: argparse.Namespace, out: TextIO) -> int:
    from gateway import replay

    given = [f for f in ("capacity_rps", "base_rps", "pulse_rps") if getattr(args, f) is not None]
    if given:
        p.error(f"--trace replays the trace's arrivals: give it without --{given[0].replace('_', '-')}")
    if not (math.isfinite(args.speed) and args.speed > 0):
        p.error(f"--speed must be finite and > 0, not {args.speed}")
    try:
        trace = traces.read_trace(Path(args.trace), speed=args.speed)
        result = asyncio.run(
            replay.run_trace(
                args.url,
                trace,
                model=args.model,
                prompt=args.prompt,
                default_max_tokens=traces.DEFAULT_GENERATED_TOKENS if args.max_tokens is None else args.max_tokens,
                max_requests=args.max_requests,
                duration_s=args.duration_s,
                request_timeout_s=args.request_timeout_s,
                on_second=_progress,
            )
        )
    except traces.BadTrace as err:
        p.error(str(err))
    except replay.MissingModel as err:
        p.error(f"{args.trace}: {err} (--model M)")
    except ValueError as err:  # a bound below 0, a bad URL
        p.error(str(err))
    if trace.reordered:
        print(f"note: {trace.reordered} rows of {args.trace} were out of time order; replayed sorted", file=out)
    print_report(result, out)
    _write_files(result, args)
    return 0


def print_report(result: LoadResult, out: TextIO) -> None:
    """The per-second table and the totals, and a warning when sends fell `LATE_WARN_S` or more behind."""
    # The table comes once every answer is in: a second's 200s and 504s arrive after its sends.
    head = f"{'t':>4} {'phase':<6} {'offered':>7} {'sent':>5} {'200':>5} {'429':>5} {'504':>5} {'err':>4}"
    print(head + f" {'p50_ms':>8} {'p99_ms':>8} {'late_ms':>8}", file=out)
    for s in result.seconds:
        row = s.row()
        p50 = "-" if row["p50_ms"] is None else f"{row['p50_ms']:.1f}"
        p99 = "-" if row["p99_ms"] is None else f"{row['p99_ms']:.1f}"
        late = "-" if row["late_max_ms"] is None else f"{row['late_max_ms']:.1f}"
        print(
            f"{s.t:>4} {s.phase:<6} {s.offered_rps:>7.1f} {s.sent:>5} {s.ok:>5} {s.rejected_429:>5} "
            f"{s.timeouts_504:>5} {s.errors + s.other_status:>4} {p50:>8} {p99:>8} {late:>8}",
            file=out,
        )
    summary = result.summary()
    print("total: " + ", ".join(f"{k} {v}" for k, v in summary.items()), file=out)
    late_max = result.late_ms(100)
    if late_max is not None and late_max >= LATE_WARN_S * 1000:
        print(
            f"behind schedule: sends went out up to {late_max:.0f} ms late (p99 {result.late_ms(99):.0f} ms): this "
            "client could not keep up with its schedule, so the server saw the arrivals later than asked for"
            + (" (lower --speed)" if result.trace is not None else ""),
            file=out,
        )


def _write_files(result: LoadResult, args: argparse.Namespace) -> None:
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            f.write(result.to_csv())
