"""The demo's PNG, from report.json alone: three panels sharing the time axis.

1. requests/s: the offered load (by send second), the 200s served (by the second they *completed* in, so the line
   shows what the replicas delivered and stays under their capacity unless they really did more) and the capacity
   of the replicas ready;
2. latency: p50 and p99 per send second of every answer (a 504 counts as the wait it was), and every answer other
   than 200 per send second;
3. the gateway's queue depth, and the replicas ready, activating and needed by each second's offered load.

The title names the run's own pulse and pool (from its config). matplotlib is imported here only (with the headless
Agg backend), so `pulsescale demo --help` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot", "title_of"]


def title_of(report: dict[str, Any]) -> str:
    """The run in one line: its pulse, its pool and what the pulse needed."""
    cfg = report["config"]
    pool, fleet = cfg.get("pool_size"), cfg.get("fleet_slots")
    needed = report["needed_replicas"]
    pulse = report["pulse"]
    where = f"a warm pool of {pool} of {fleet} slots"
    if pool is not None and pool < needed:
        where += ", the rest from the cold path"
    return (
        f"pulsescale demo: a {cfg['pulse'] * 100:.0f} % pulse ({pulse['rps']:g} req/s for {cfg['pulse_s']:g} s, "
        f"{needed} replicas needed) on {where}"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def _caption(report: dict[str, Any]) -> str:
    ttc = report["time_to_capacity_s"]
    p99 = report["latency_ms"]["pulse"]["p99"]
    rs = report["replicas"]
    non200 = report["non_200"]
    errors = ", ".join(f"{k} x{n}" for k, n in report["responses_by_status"].items() if k != "200") or "none"
    return (
        f"answers other than 200: {non200} ({errors})   pulse p99: {_ms(p99)}   "
        f"time to capacity: {'never' if ttc is None else f'{ttc:.2f} s'}   "
        f"replica-s: {rs['replica_seconds']:g} for {rs['needed_replica_seconds']:g} needed"
    )


def plot(report: dict[str, Any], path: Path, *, title: str = "") -> Path:
    """Write the PNG of `report` to `path` and return `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    ticks = report["ticks"]
    cap_rps = report.get("replica_capacity_rps") or 0.0
    pulse = report["pulse"]
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(11, 9), sharex=True, height_ratios=(3, 2.2, 2.2))
    try:
        ts = [s["t"] for s in series]
        tt = [t["t"] for t in ticks]
        # Capacity under the lines, served (solid) over it, offered (dashed, on top) last: where served meets the
        # offered load the dashes still show.
        top.step(
            tt,
            [t["ready"] * cap_rps for t in ticks],
            where="post",
            label="capacity (ready x req/s each)",
            color="tab:gray",
            zorder=2,
        )
        top.step(
            ts,
            [s.get("served", s["ok"]) for s in series],
            where="post",
            label="served: 200s by completion second",
            color="tab:green",
            linewidth=2.4,
            alpha=0.8,
            zorder=3,
        )
        top.step(
            ts,
            [s["sent"] for s in series],
            where="post",
            label="offered (sent per second)",
            color="tab:blue",
            linestyle="--",
            linewidth=1.6,
            zorder=4,
        )
        top.set_ylabel("requests / s")
        top.set_ylim(bottom=0)
        top.legend(loc="upper right", fontsize=8)

        for key, label, color in (("p50_ms", "p50", "tab:blue"), ("p99_ms", "p99", "tab:red")):
            known = [s for s in series if s[key] is not None]
            mid.step([s["t"] for s in known], [s[key] for s in known], where="post", label=label, color=color, zorder=3)
        lat = [s[k] for s in series for k in ("p50_ms", "p99_ms") if s[k] is not None]
        if lat and max(lat) > 20 * max(1.0, min(lat)):  # a cold path's seconds beside 50 ms answers: log scale
            from matplotlib.ticker import FuncFormatter

            mid.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            mid.yaxis.set_major_formatter(plain)
            mid.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        else:
            mid.set_ylim(bottom=0, top=max(lat, default=1.0) * 1.15)
        mid.set_ylabel("latency, ms (by send second)")
        errs = mid.twinx()
        timeouts = [s["timeouts"] for s in series]
        errs.bar(ts, timeouts, width=0.9, align="edge", color="tab:red", alpha=0.3, label="504s per s", zorder=1)
        errs.bar(
            ts,
            [s["errors"] for s in series],
            bottom=timeouts,
            width=0.9,
            align="edge",
            color="tab:orange",
            alpha=0.4,
            label="other non-200 per s",
            zorder=1,
        )
        errs.set_ylabel("non-200 answers / s")
        errs.set_ylim(bottom=0, top=max(4, *(s["timeouts"] + s["errors"] for s in series)) * 1.15 if series else 4)
        mid.legend(loc="upper left", fontsize=8)
        errs.legend(loc="upper right", fontsize=8)

        bottom.plot(tt, [t["queue_depth"] for t in ticks], label="gateway queue depth", color="tab:orange")
        bottom.set_ylabel("queued requests")
        bottom.set_ylim(bottom=0, top=max(5, *(t["queue_depth"] for t in ticks)) * 1.1 if ticks else 5)
        replicas = bottom.twinx()
        replicas.step(tt, [t["ready"] for t in ticks], where="post", label="replicas ready", color="tab:purple")
        replicas.step(
            tt, [t["activating"] for t in ticks], where="post", label="activating", color="tab:pink", linestyle="--"
        )
        needed = [(s["t"], s["needed"]) for s in series if s.get("needed") is not None]
        if needed:
            replicas.step(
                [t for t, _ in needed],
                [n for _, n in needed],
                where="post",
                label="needed by the offered load",
                color="black",
                linewidth=0.9,
                linestyle=":",
            )
        replicas.set_ylabel("replicas")
        fleet = report["config"].get("fleet_slots") or max((t["ready"] for t in ticks), default=1)
        top_n = max([fleet, report["needed_replicas"], *(n for _, n in needed)])
        replicas.set_ylim(bottom=0, top=top_n + 1)
        bottom.legend(loc="upper left", fontsize=8)
        replicas.legend(loc="upper right", fontsize=8)
        bottom.set_xlabel("seconds since the load started")
        for ax in (top, mid, bottom):
            ax.axvspan(pulse["start_s"], pulse["end_s"], color="tab:red", alpha=0.07)
        fig.suptitle(title or title_of(report), fontsize=11)
        top.set_title(_caption(report), fontsize=8.5)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
