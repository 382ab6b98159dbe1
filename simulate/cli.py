"""`pulsescale simulate`: HPA v2, KEDA, Knative KPA and our policy on the same pulse, in a discrete-event simulation.

Our policy is the real `autoscaler.policy.decide`; the baselines follow their documented algorithms with their
default settings (`simulate.policies` cites the pages). Every baseline pays the article's cold start per new pod;
ours activates warm slots (claim -> ready from --activations FILE or --activation-s) while its pool lasts, then
pays the same cold start. Prints a table per policy and writes simulate.json and simulate.png into --out.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import replace
from pathlib import Path

from simulate import report, scenarios
from simulate.engine import Delay, Empirical, Fixed
from warmpool.errors import PulsescaleError

__all__ = ["BadActivations", "load_activations", "main"]

_BENCH_ROW = re.compile(r"^claim->ready\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"^\s*([\d.]+(?:e[-+]?\d+)?)\s*(ms|s)?\s*$", re.IGNORECASE)


class BadActivations(PulsescaleError):
    """The --activations file holds no usable durations."""


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
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(scenarios.SCENARIOS), default="seed", help="[seed]")
    p.add_argument("--instances", type=int, help="replicas the pulse needs beyond the provisioned fleet [seed: 100]")
    p.add_argument("--pool-size", type=int, help="our warm slots [the burst + 20 %%]")
    p.add_argument("--activations", type=Path, help="measured claim -> ready times (see `load_activations`)")
    p.add_argument("--activation-s", type=float, help=f"a fixed claim -> ready instead [{scenarios.DEFAULT_WARM_S}]")
    p.add_argument("--cold-s", type=float, help="cold start per new pod [the article's 1.5+120+18+45.5 = 185 s]")
    p.add_argument("--timeout-s", type=float, help="queued this long -> 504 [60]")
    p.add_argument("--pulse-s", type=float, help="how long the pulse is held [600]")
    p.add_argument("--seed", type=int, help="arrival randomness [1]")
    p.add_argument("--out", type=Path, default=Path("pulsescale-simulate"), help="[./pulsescale-simulate]")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)

    if args.instances is not None and args.instances < 1:
        p.error("--instances must be >= 1")
    sc = scenarios.make(args.scenario, instances=args.instances)
    if args.pool_size is not None:
        sc = replace(sc, pool_size=max(args.pool_size, 0))
    if args.cold_s is not None:
        sc = replace(sc, cold_s=max(args.cold_s, 0.0))
    if args.timeout_s is not None:
        sc = replace(sc, service=replace(sc.service, timeout_s=args.timeout_s))
    if args.pulse_s is not None:
        sc = replace(sc, pulse_s=args.pulse_s)
    if args.seed is not None:
        sc = replace(sc, seed=args.seed)
    warm: Delay
    if args.activations is not None:
        warm = load_activations(args.activations)
        where = f"{len(warm.seconds)} measured activations from {args.activations}"
    else:
        warm = Fixed(args.activation_s if args.activation_s is not None else scenarios.DEFAULT_WARM_S)
        where = f"a fixed {warm.seconds:g} s"
    t0 = time.perf_counter()
    results = scenarios.run(sc, warm=warm)
    took = time.perf_counter() - t0
    print(report.table(sc, results))
    print(f"\nours: warm path {where}, pool {scenarios.pool_size(sc)} slots; simulated in {took:.1f} s")
    out = report.write_json(sc, results, args.out / "simulate.json", warm_path=where, wall_s=round(took, 2))
    print(f"wrote {out}")
    if not args.no_plot:
        print(f"wrote {report.plot(sc, results, args.out / 'simulate.png')}")
    return 0
