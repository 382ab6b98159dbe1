"""The demo's PNG: offered load, capacity, queue depth and 504s over time, from report.json alone.

matplotlib is imported here only (with the headless Agg backend), so `pulsescale demo --help` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(report: dict[str, Any], path: Path, *, title: str = "") -> Path:
    """Write the PNG of `report` to `path` (two panels sharing the time axis) and return `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    ticks = report["ticks"]
    cap_rps = report.get("replica_capacity_rps") or 0.0
    pulse = report["pulse"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=(3, 2))
    try:
        ts = [s["t"] for s in series]
        top.step(ts, [s["sent"] for s in series], where="post", label="offered load (req/s)", color="tab:blue")
        top.step(ts, [s["ok"] for s in series], where="post", label="served, 200 (req/s)", color="tab:green")
        tt = [t["t"] for t in ticks]
        top.plot(tt, [t["ready"] * cap_rps for t in ticks], label="capacity (ready x req/s each)", color="tab:gray")
        top.bar(
            ts, [s["timeouts"] for s in series], width=0.9, align="edge", color="tab:red", alpha=0.7, label="504s per s"
        )
        top.set_ylabel("requests / s")
        top.legend(loc="upper left", fontsize=8)
        bottom.plot(tt, [t["queue_depth"] for t in ticks], label="gateway queue depth", color="tab:orange")
        bottom.set_ylabel("queued requests")
        bottom.set_ylim(bottom=0, top=max(5, *(t["queue_depth"] for t in ticks)) * 1.1 if ticks else 5)
        replicas = bottom.twinx()
        replicas.step(tt, [t["ready"] for t in ticks], where="post", label="replicas ready", color="tab:purple")
        replicas.step(
            tt, [t["activating"] for t in ticks], where="post", label="activating", color="tab:pink", linestyle="--"
        )
        replicas.axhline(report["needed_replicas"], color="black", linewidth=0.8, linestyle=":", label="needed")
        replicas.set_ylabel("replicas")
        fleet = report["config"].get("fleet_slots") or max((t["ready"] for t in ticks), default=1)
        replicas.set_ylim(bottom=0, top=max(fleet, report["needed_replicas"]) + 1)
        h1, l1 = bottom.get_legend_handles_labels()
        h2, l2 = replicas.get_legend_handles_labels()
        bottom.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
        bottom.set_xlabel("seconds since the load started")
        for ax in (top, bottom):
            ax.axvspan(pulse["start_s"], pulse["end_s"], color="tab:red", alpha=0.07)
        ttc = report["time_to_capacity_s"]
        caption = (
            f"504s: {report['timeouts']}   time to capacity: {'never' if ttc is None else f'{ttc:.2f} s'}   "
            f"needed replicas: {report['needed_replicas']}"
        )
        fig.suptitle(title or "pulsescale demo: a 300 % pulse on a warm pool", fontsize=11)
        top.set_title(caption, fontsize=9)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
