"""Replaying a request trace in the simulation (`pulsescale simulate --trace FILE`), and the bursty trace the tests
and the README's figures use (`--make-trace bursty`).

A trace's requests land on the 100 ms grid as cohorts, each with its own service time from its tokens
(`warmpool.traces.Trace.service_s`). A trace has no "pulse" and no replica count it is known to need: the scenario
built for it starts at the floor, runs until the last request could have finished, and its `needed` is the oracle's
peak (the most replicas any moment of the trace fills if nobody waited), which also sizes the default pool.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Final

import numpy as np

from simulate.engine import STEP_S, Arrivals, Service
from simulate.scenarios import Scenario
from warmpool.traces import Trace

__all__ = ["BURSTY", "arrivals_of", "scenario_for", "write_bursty"]

TAIL_S: Final = 120.0
"""Simulated after the last arrival: its requests finish (or time out at 60 s) and the policies scale in."""


def arrivals_of(trace: Trace) -> Arrivals:
    """The trace's requests as cohorts: one per step and service time (in steps)."""
    if len(trace) == 0:
        return Arrivals(np.zeros(0, np.int64), np.zeros(0, np.int64), np.ones(0, np.int64))
    step = np.floor(trace.t_s / STEP_S + 1e-9).astype(np.int64)
    svc = np.maximum(np.rint(trace.service_s() / STEP_S), 1).astype(np.int64)
    width = int(svc.max()) + 1
    keys, counts = np.unique(step * width + svc, return_counts=True)  # sorted: by step, then service
    return Arrivals(keys // width, counts.astype(np.int64), keys % width)


def scenario_for(
    trace: Trace, arrivals: Arrivals, *, service: Service, min_replicas: int, name: str | None = None
) -> Scenario:
    """The scenario a trace runs in (module doc)."""
    svc = int(arrivals.service_steps.max()) if len(arrivals.steps) else 1
    duration = math.ceil((trace.duration_s + svc * STEP_S + TAIL_S) / STEP_S) * STEP_S
    steps = round(duration / STEP_S)
    peak = math.ceil(int(arrivals.busy(steps).max(initial=0)) / max(service.concurrency, 1))
    mean_s = float(np.average(arrivals.service_steps, weights=arrivals.counts)) * STEP_S if len(arrivals.steps) else 1
    service = replace(service, service_s=round(mean_s, 3))  # the typical request: the oracle's grain, a drain
    return Scenario(
        name or f"trace {trace.source}",
        instances=max(peak, 1),
        service=service,
        from_zero=True,
        warmup_s=0.0,
        pulse_s=duration,
        after_s=0.0,
        min_replicas=min_replicas,
        trace=True,
    )


BURSTY: Final = {
    "hours": 1.0,
    "mean_rps": 2.0,
    "burst_s": 10.0,
    "burst_factor": 15.0,
    "idle_factor": 0.3,
}
"""The bursty trace of issue 23: an hour of idle minutes at 30 % of the mean rate, with 10-second bursts at 15x the
mean (about 17 of them), Azure LLM trace columns; generated tokens log-normal around 200, prompts around 1,000."""


def write_bursty(path: Path, *, seed: int = 7) -> Path:
    """Write the bursty trace (`BURSTY`) to `path` in the Azure format, drawn with `seed`."""
    rng = np.random.default_rng(seed)
    p = BURSTY
    total_s = p["hours"] * 3600.0
    burst_rps, idle_rps = p["mean_rps"] * p["burst_factor"], p["mean_rps"] * p["idle_factor"]
    # Bursts carry what the idle minutes leave of the mean: n x burst_s x burst_rps + idle = mean x total.
    n = max(round((p["mean_rps"] - idle_rps) * total_s / (p["burst_s"] * (burst_rps - idle_rps))), 1)
    gap = total_s / n
    starts = np.sort(np.arange(n) * gap + rng.uniform(0.1 * gap, 0.9 * gap - p["burst_s"], n))
    times = [rng.uniform(0.0, total_s, rng.poisson(idle_rps * total_s))]
    for s in starts:
        times.append(s + rng.uniform(0.0, p["burst_s"], rng.poisson((burst_rps - idle_rps) * p["burst_s"])))
    t = np.sort(np.concatenate(times))
    gen = np.clip(rng.lognormal(math.log(200), 0.6, len(t)), 1, 4000).astype(np.int64)
    ctx = np.clip(rng.lognormal(math.log(1000), 0.8, len(t)), 1, 30000).astype(np.int64)
    base = np.datetime64("2023-11-16T18:00:00", "us")
    stamps = np.datetime_as_string(base + (t * 1e6).astype("timedelta64[us]"), unit="us")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        f.writelines(f"{s.replace('T', ' ')}0,{c},{g}\n" for s, c, g in zip(stamps, ctx, gen, strict=True))
    return path


def with_pool(sc: Scenario, pool: int | None) -> Scenario:
    return sc if pool is None else replace(sc, pool_size=max(pool, 0))
