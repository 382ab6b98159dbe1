"""`pulsescale simulate`: HPA v2, KEDA, Knative KPA and our policy on the same pulse, in a discrete-event simulation.

Our policy is the real `autoscaler.decide.policy.decide`; the baselines follow their documented algorithms with their
default settings (`simulate.policies` cites the pages). Every baseline pays the article's cold start per new pod;
ours activates warm slots (claim -> ready from --activations FILE or --activation-s) while its pool lasts, then
pays the same cold start. Prints a table per policy and writes simulate.json and simulate.png into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from simulate import replay, report, scenarios
from simulate.engine import STEP_S, Arrivals, Delay, Empirical, Fixed, Service
from warmpool import durations
from warmpool.errors import PulsescaleError
from warmpool.traces import BadTrace, read_trace

__all__ = ["BadActivations", "load_activations", "main"]

_BENCH_ROW = re.compile(r"^claim->ready\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"^\s*([\d.]+(?:e[-+]?\d+)?)\s*(ms|s)?\s*$", re.IGNORECASE)


class BadActivations(PulsescaleError):
    """The --activations file holds no usable durations."""


_duration = durations.duration_arg(allow_zero=True)
"""Every time flag (``--activation-s 2.55s``, ``--pulse-s 10m``, plain seconds as before), as every other command
reads one (`warmpool.durations`)."""


def load_activations(path: Path) -> Empirical:
    """Measured claim -> ready durations, in seconds, from one of:

    - the output of `pulsescale bench activate` (its ``claim->ready`` row, p50/p99/max in ms: a distribution with
      half its mass at p50, rising linearly to p99, and the max as the last 1 %);
    - a JSON list of seconds, or an object with ``activations``: a list of seconds or of objects with a
      ``total_s`` / ``claim_to_ready_s`` / ``seconds`` field (as `pulsescale demo` writes in report.json);
    - text, one duration a line (seconds, or with an ``ms`` suffix); ``#`` starts a comment.
    """
    try:
        text = path.read_text()
    except OSError as err:
        raise BadActivations(f"cannot read --activations {path}: {err.strerror}; give a readable file") from None
    values: list[float] = []
    row = _BENCH_ROW.search(text)
    if row:
        p50, p99, mx = (float(x) / 1e3 for x in row.groups())
        values = [p50] * 50 + [p50 + (p99 - p50) * i / 49 for i in range(1, 50)] + [mx]
    elif text.lstrip().startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise BadActivations(f"--activations {path}: not valid JSON ({err})") from None
        items = doc.get("activations", []) if isinstance(doc, dict) else doc
        for item in items if isinstance(items, list) else []:
            if isinstance(item, int | float):
                values.append(float(item))
            elif isinstance(item, dict):
                for key in ("total_s", "claim_to_ready_s", "seconds"):
                    if isinstance(item.get(key), int | float):
                        values.append(float(item[key]))
                        break
    else:
        for line in text.splitlines():
            line = line.split("#", 1)[0]
            if not line.strip():
                continue
            m = _NUMBER.match(line)
            if m is None:
                raise BadActivations(f"--activations {path}: cannot read {line.strip()!r} as a duration")
            values.append(float(m.group(1)) / (1e3 if (m.group(2) or "").lower() == "ms" else 1.0))
    values = [v for v in values if v >= 0]
    if not values:
        raise BadActivations(
            f"--activations {path}: no durations found; give `pulsescale bench activate` output, a JSON list of "
            "seconds, or one duration a line"
        )
    return Empirical(tuple(values))


def main(argv: list[str], prog: str) -> int:
    p = durations.dashed_values(
        argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    )
    p.add_argument("--scenario", choices=sorted(scenarios.SCENARIOS), default="seed", help="[seed]")
    p.add_argument("--instances", type=int, help="replicas the pulse needs beyond the provisioned fleet [seed: 100]")
    p.add_argument("--pool-size", type=int, help="our warm slots [the burst + 20 %%]")
    p.add_argument("--activations", type=Path, help="measured claim -> ready times (see `load_activations`)")
    p.add_argument(
        "--activation-s",
        type=_duration,
        metavar="DURATION",
        help=f"a fixed claim -> ready instead [{scenarios.DEFAULT_WARM_S}]",
    )
    p.add_argument(
        "--cold-s",
        type=_duration,
        metavar="DURATION",
        help="cold start per new pod [the article's 1.5+120+18+45.5 = 185 s]",
    )
    p.add_argument("--timeout-s", type=_duration, metavar="DURATION", help="queued this long -> 504 [60]")
    p.add_argument("--pulse-s", type=_duration, metavar="DURATION", help="how long the pulse is held [600]")
    p.add_argument("--seed", type=int, help="arrival randomness [1]")
    p.add_argument("--trace", type=Path, help="replay a request trace instead (Azure LLM CSV or t_s[,model][,tokens])")
    p.add_argument("--speed", type=float, default=1.0, help="with --trace: compress time this many times [1]")
    p.add_argument("--model", help="with --trace: only the requests naming this model (plain traces)")
    p.add_argument("--min-replicas", type=int, default=1, help="with --trace: every policy's floor [1]")
    p.add_argument("--concurrency", type=int, default=8, help="requests one replica serves at once [8]")
    p.add_argument(
        "--stabilization-s",
        type=_duration,
        metavar="DURATION",
        help="our scaleDownStabilizationSeconds (set: revision 8's windows, 60 s period, 50 %%) [unset: the hold "
        "from the lead time]",
    )
    p.add_argument("--make-trace", choices=["bursty"], help="write the named trace to --out and exit")
    p.add_argument("--no-pool-search", action="store_true", help="skip the smallest-pool search (a few more runs)")
    p.add_argument("--out", type=Path, default=Path("pulsescale-simulate"), help="[./pulsescale-simulate]")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)

    if args.make_trace:
        path = replay.write_bursty(args.out / f"{args.make_trace}.csv", seed=args.seed if args.seed is not None else 7)
        print(f"wrote {path}")
        return 0
    if args.instances is not None and args.instances < 1:
        p.error("--instances must be >= 1")
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.min_replicas < 0:
        p.error("--min-replicas must be >= 0")
    if not (math.isfinite(args.speed) and args.speed > 0):
        p.error("--speed must be a number > 0")
    warm: Delay
    if args.activations is not None:
        warm = load_activations(args.activations)
        where = f"{len(warm.seconds)} measured activations from {args.activations}"
    else:
        warm = Fixed(args.activation_s if args.activation_s is not None else scenarios.DEFAULT_WARM_S)
        where = f"a fixed {warm.seconds:g} s"
    service = Service(concurrency=args.concurrency)
    if args.timeout_s is not None:
        service = replace(service, timeout_s=args.timeout_s)
    t0 = time.perf_counter()
    if args.trace is not None:
        try:
            trace = read_trace(args.trace, speed=args.speed)
        except BadTrace as err:
            print(f"pulsescale simulate: {err}", file=sys.stderr)
            return 2
        if args.model:
            trace = trace.for_model(args.model)
        arrivals = replay.arrivals_of(trace)
        sc = replay.scenario_for(trace, arrivals, service=service, min_replicas=args.min_replicas)
        read_s = time.perf_counter() - t0
        what = f"{len(trace):,} requests over {trace.duration_s:,.0f} s (x{args.speed:g}), read in {read_s:.1f} s"
    else:
        sc = scenarios.make(args.scenario, instances=args.instances)
        sc = replace(sc, service=replace(sc.service, concurrency=args.concurrency, timeout_s=service.timeout_s))
        if args.pulse_s is not None:
            sc = replace(sc, pulse_s=args.pulse_s)
        if args.seed is not None:
            sc = replace(sc, seed=args.seed)
        steps = round(sc.duration_s / STEP_S)
        arrivals = Arrivals.from_load(sc.load, steps=steps, service_s=sc.service.service_s, seed=sc.seed)
        what = ""
    if args.pool_size is not None:
        sc = replace(sc, pool_size=max(args.pool_size, 0))
    if args.stabilization_s is not None:
        if not (math.isfinite(args.stabilization_s) and 0 <= args.stabilization_s <= 86_400):
            p.error("--stabilization-s must be between 0 and 86400")
        sc = replace(sc, stabilization_s=args.stabilization_s)
    if args.cold_s is not None:
        sc = replace(sc, cold_s=max(args.cold_s, 0.0))
    results = scenarios.run_arrivals(sc, arrivals, warm=warm)
    ours = next(r for r in results if r.policy == scenarios.OURS)
    took = time.perf_counter() - t0
    recommended = None if args.no_pool_search else scenarios.recommend_pool(sc, arrivals, warm=warm, ours=ours)
    title = None
    if sc.trace:
        title = (
            f"trace {args.trace}: {what}; {sc.service.concurrency} concurrent per replica, service from tokens "
            f"(mean {sc.service.service_s:g} s), 504 after {sc.service.timeout_s:g} s queued; floor "
            f"{sc.floor}; cold start {sc.cold_s:g} s; the oracle's peak {sc.needed} replicas"
        )
    print(report.table(sc, results, title=title))
    pool = scenarios.pool_size(sc)
    print(f"\nours: warm path {where}, pool {pool} slots; simulated in {took:.1f} s")
    print(report.pool_line(ours, pool, recommended))
    out = report.write_json(
        sc, results, args.out / "simulate.json", warm_path=where, wall_s=round(took, 2), pool_size=pool,
        recommended_pool_size=recommended, trace=str(args.trace) if args.trace else None,
        speed=args.speed if args.trace else None,
    )  # fmt: skip
    print(f"wrote {out}")
    if not args.no_plot:
        print(f"wrote {report.plot(sc, results, args.out / 'simulate.png')}")
    return 0
