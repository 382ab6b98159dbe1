"""The simulation's outputs: the comparison table, `simulate.json`, and the PNG in the demo's style (offered load,
capacity, served and 504s per second on the left; queue depth, ready and starting replicas on the right; one row
per policy, the pulse shaded). matplotlib is imported only when a PNG is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from simulate.engine import Result
from simulate.scenarios import Scenario

__all__ = ["oracle_of", "plot", "summary", "table", "write_json"]


def summary(r: Result, oracle: Result | None = None) -> dict[str, Any]:
    """One policy's figures, all computed from the run; ratios against `oracle` when there is one."""
    replica = r.replica_gpu_s
    return {
        "policy": r.policy,
        "requests": r.requests,
        "ok": r.ok,
        "timeouts": r.timeouts,
        "rejected": r.rejected,
        "queued_at_end": r.queued_at_end,
        "in_flight_at_end": r.in_flight_at_end,
        "needed_replicas": r.needed,
        "time_to_capacity_s": r.time_to_capacity_s,
        "p50_wait_s": round(r.wait_percentile_s(50), 3),
        "p99_wait_s": round(r.wait_percentile_s(99), 3),
        "max_wait_s": round(r.max_wait_s, 3),
        "p50_queue_wait_s": round(r.wait_percentile_s(50), 3),
        "p99_queue_wait_s": round(r.wait_percentile_s(99), 3),
        "gpu_seconds": round(r.gpu_s, 1),
        "gpu_s": round(r.gpu_s, 1),
        "replica_gpu_seconds": round(replica, 1),
        "starting_gpu_seconds": round(r.starting_gpu_s, 1),
        "serving_gpu_seconds": round(r.serving_gpu_s, 1),
        "draining_gpu_seconds": round(r.draining_gpu_s, 1),
        "standby_gpu_seconds": round(r.standby_gpu_s, 1),
        "standby_gpu_s": round(r.standby_gpu_s, 1),
        "gpu_seconds_vs_oracle": (
            round(replica / oracle.replica_gpu_s, 3) if oracle is not None and oracle.replica_gpu_s > 0 else None
        ),
        "warm_starts": r.warm_starts,
        "cold_starts": r.cold_starts,
        "peak_replicas": r.peak_replicas,
        "peak_desired": int(max(r.series["desired"], default=0)),
    }


def oracle_of(results: list[Result]) -> Result | None:
    return next((r for r in results if r.policy == "oracle"), None)


def _ttc(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


def _wait(r: Result, q: float | None, timeout_s: float) -> str:
    v = r.max_wait_s if q is None else r.wait_percentile_s(q)
    return f">={v:g} s" if r.timeouts and v >= timeout_s else f"{v:.1f} s"


def table(sc: Scenario, results: list[Result], *, title: str | None = None) -> str:
    pulse = f"{sc.pulse_rps:g} req/s" if sc.from_zero else f"{sc.pulse * 100:.0f} %"
    head = title or (
        f"scenario {sc.name}: {sc.provisioned} replicas provisioned, a {pulse} pulse at "
        f"{sc.warmup_s:.0f} s for {sc.pulse_s:.0f} s needs {sc.needed} ({sc.instances} more); "
        f"{sc.service.concurrency} concurrent x {sc.service.service_s:g} s per replica, 504 after "
        f"{sc.service.timeout_s:g} s queued; cold start {sc.cold_s:g} s"
    )
    oracle = oracle_of(results)
    cols = (
        f"{'policy':<12}{'504s':>8}{'to cap.':>9}{'p50 wait':>9}{'p99 wait':>9}{'max wait':>9}"
        f"{'replica GPU-s':>14}{'x oracle':>9}{'standby':>9}{'GPU-s':>9}{'peak':>6}{'warm':>6}{'cold':>6}"
    )
    lines = [head, "", cols]
    t = sc.service.timeout_s
    for r in results:
        s = summary(r, oracle)
        ratio = s["gpu_seconds_vs_oracle"]
        lines.append(
            f"{r.policy:<12}{r.timeouts:>8,}{'-' if sc.trace else _ttc(r.time_to_capacity_s):>9}"
            f"{_wait(r, 50, t):>9}{_wait(r, 99, t):>9}"
            f"{_wait(r, None, t):>9}{r.replica_gpu_s:>14,.0f}{'-' if ratio is None else f'{ratio:.2f}':>9}"
            f"{r.standby_gpu_s:>9,.0f}{r.gpu_s:>9,.0f}{r.peak_replicas:>6}{r.warm_starts:>6}{r.cold_starts:>6}"
        )
    lines += [
        "",
        "to cap.: pulse start -> ready replicas >= needed (none on a trace); waits are in the gateway queue, a 504",
        "counted at the timeout; replica GPU-s: starting + serving + draining replicas, x oracle its ratio to the",
        "oracle's (which knows the load, starts each replica one activation ahead from warm slots that cost nothing",
        "idle); standby: idle warm slots of the pool, beside it; GPU-s: both; peak: most replicas held at once;",
        "warm/cold: replica starts.",
    ]
    return "\n".join(lines)


def pool_line(ours: Result, pool: int, recommended: int | None) -> str:
    """The warm pool's own figure: what its idle slots cost, and the smallest pool that kept ours at 0 504s."""
    rec = (
        "ours had 504s even with this pool: a larger pool or a higher floor"
        if recommended is None
        else f"the smallest pool that keeps ours at 0 504s on this load: {recommended}"
    )
    return (
        f"warm pool: {pool} slots, {ours.standby_gpu_s:,.0f} GPU-s idle standby, at most {ours.pool_peak_in_use} "
        f"out at once; {rec}"
    )


def write_json(sc: Scenario, results: list[Result], path: Path, **extra: Any) -> Path:
    doc = {
        "scenario": {
            "name": sc.name,
            "instances": sc.instances,
            "provisioned": sc.provisioned,
            "needed_replicas": sc.needed,
            "pulse": sc.pulse,
            "base_rps": sc.base_rps,
            "pulse_rps": sc.pulse_rps,
            "pulse_start_s": sc.warmup_s,
            "pulse_end_s": sc.warmup_s + sc.pulse_s,
            "duration_s": sc.duration_s,
            "concurrency": sc.service.concurrency,
            "service_s": sc.service.service_s,
            "timeout_s": sc.service.timeout_s,
            "cold_start_s": sc.cold_s,
            "seed": sc.seed,
            "trace": sc.trace,
        },
        "needed_replicas": None if sc.trace else sc.needed,
        "oracle_peak_replicas": sc.needed if sc.trace else None,
        "policies": [summary(r, oracle_of(results)) | {"series": r.series} for r in results],
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


def plot(sc: Scenario, results: list[Result], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(results)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.6 * rows + 0.8), sharex=True, squeeze=False)
    try:
        t0, t1 = sc.warmup_s, sc.warmup_s + sc.pulse_s
        for (left, right), r in zip(axes, results, strict=True):
            s = r.series
            ts = s["t"]
            left.step(ts, s["offered"], where="post", label="offered load (req/s)", color="tab:blue")
            left.step(ts, s["served"], where="post", label="served, 200 (req/s)", color="tab:green")
            left.plot(ts, s["capacity"], label="capacity (ready x req/s each)", color="tab:gray")
            left.bar(ts, s["timeouts"], width=1.0, align="edge", color="tab:red", alpha=0.7, label="504s per s")
            left.set_ylabel("requests / s")
            ttc = _ttc(r.time_to_capacity_s)
            left.set_title(f"{r.policy}: {r.timeouts:,} x 504, capacity after {ttc}", fontsize=9, loc="left")
            right.plot(ts, s["queued"], label="gateway queue depth", color="tab:orange")
            right.set_ylabel("queued requests")
            reps = right.twinx()
            reps.step(ts, s["ready"], where="post", label="replicas ready", color="tab:purple")
            reps.step(ts, s["starting"], where="post", label="starting", color="tab:pink", linestyle="--")
            reps.axhline(r.needed, color="black", linewidth=0.8, linestyle=":", label="needed")
            reps.set_ylabel("replicas")
            for ax in (left, right):
                ax.axvspan(t0, t1, color="tab:red", alpha=0.07)
        h1, l1 = axes[0][0].get_legend_handles_labels()
        axes[0][0].legend(h1, l1, loc="upper left", fontsize=7)
        h2, l2 = axes[0][1].get_legend_handles_labels()
        twin = next(a for a in fig.axes if a not in axes.ravel())  # the first row's replica axis
        h3, l3 = twin.get_legend_handles_labels()
        axes[0][1].legend(h2 + h3, l2 + l3, loc="upper left", fontsize=7)
        for ax in axes[-1]:
            ax.set_xlabel("seconds since the load started")
        fig.suptitle(
            f"pulsescale simulate --scenario {sc.name}: {sc.pulse * 100:.0f} % pulse, "
            f"{sc.needed} replicas needed, cold start {sc.cold_s:g} s",
            fontsize=11,
        )
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
