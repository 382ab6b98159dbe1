"""The table a run ends with (headless runs, logs and the live view alike): the article's load test with a column of
this run's figures, what the pulse cost (latency, every answer other than 200, replica-seconds against the needed
ones, the base, the cold path's asks, the steps after the pulse) and each activation's stages; and for
``--source both`` the two runs side by side (`comparison`, `compare_table`). Pure: it reads report.json
(`demo.report.build_report`) only.
"""

from __future__ import annotations

from typing import Any, Final

from demo.report import ARTICLE, STAGES

__all__ = ["COMPARED_HOW", "article_table", "compare_table", "comparison", "cost_rows"]

COMPARED_HOW: Final = (
    "two runs of the same settings, one after the other on this machine, each from a fresh fleet (nats-server, "
    "autoscaler, agents, gateway); they differ only in where the autoscaler's demand comes from, and in a run's "
    "own noise"
)


def _fmt_s(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _rootfs_cell(r: dict[str, Any]) -> str:
    if not r.get("mounted"):
        return f"skipped ({r.get('reason') or 'not run'})"
    resident = r.get("resident_pct_at_pulse_start", r.get("resident_pct_at_mount"))
    on = r.get("slots_on_image_at_pulse_start")
    of = r.get("slots_at_pulse_start")
    return (
        f"mounted {str(r['digest'])[:19]}... once per host ({r['image_bytes'] / 1e6:.1f} MB, built "
        f"{r['build_s']:.2f} s, mount {r['mount_s'] * 1e3:.0f} ms)"
        + ("" if resident is None else f", {resident:.0f} % resident at the pulse")
        + ("" if on is None else f", {on}/{of} slots on it")
    )


def article_table(report: dict[str, Any]) -> str:
    """The article's load-test table with a column of this run's measured figures, and the stage breakdown of each
    activation (plain text: it ends headless runs and logs as well as the live view)."""
    cfg = report["config"]
    c2r = report["claim_to_ready_ms"]
    needed = report["needed_replicas"]
    cold = report["cold_path"]["node_start_to_warm_s"]
    cold_s = max(cold.values()) if cold else None
    one_pod = f"{_fmt_ms(c2r['p50'])} p50 claim->ready"
    if cold_s is not None:
        delay = cfg.get("cold_delay_s") or 0
        one_pod += f"; cold path {f'{delay:g} s delay + ' if delay else ''}{cold_s:.1f} s node start + claim"
    disk = report["host_disk_reads_during_pulse"]
    a = ARTICLE
    rootfs = report.get("rootfs") or {}
    rows = [
        ("metric", "classic (article)", "pulsescale (article)", "this run"),
        (
            "one pod, end-to-end cold start",
            f"{a['cold_start_s']['classic']} s",
            f"{a['cold_start_s']['optimised']} s",
            one_pod,
        ),
        (
            "client 504s during the pulse",
            f"{a['timeouts']['classic']:,}",
            str(a["timeouts"]["optimised"]),
            f"{report['timeouts_during_pulse']:,} (of {report['requests']:,} requests; {report['timeouts']:,} in all)",
        ),
        (
            "engine rootfs (image pull and unpack -> EROFS mount)",
            f"{a['rootfs_s']['classic']:g} s per pod",
            f"{a['rootfs_s']['optimised']} s",
            _rootfs_cell(rootfs),
        ),
        (
            "host disk reads during scale-out",
            f"{a['disk_read_iops']['classic']:,} IOPS",
            "0",
            "n/a" if disk is None else f"{disk:,} reads (/proc/diskstats, whole host)",
        ),
        (
            f"all needed instances up ({needed} here, {a['instances']} in the article)",
            f"{a['all_up_s']['classic']:.0f} s",
            f"{a['all_up_s']['optimised']} s",
            _fmt_s(report["time_to_capacity_s"]) + " after the pulse start",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    source = _source_line(report)
    lines = [
        *([source] if source else []),
        f"pulsescale demo: {cfg['nodes']} nodes x {cfg['slots_per_node']} slots, pool {cfg['pool_size']}, "
        f"base {cfg['base_rps']:g} req/s on {cfg['base_replicas']} replicas, pulse {cfg['pulse'] * 100:.0f} % "
        f"= {report['pulse']['rps']:g} req/s for {cfg['pulse_s']:g} s, needs {needed} replicas "
        f"({report['replica_capacity_rps']} req/s each)",
        "",
    ]
    for i, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    costs = cost_rows(report)
    if costs:
        w0 = max(len(k) for k, _ in costs)
        lines += ["", "what the run cost (every request's answer; replicas from the autoscaler's events):"]
        lines += [f"  {k.ljust(w0)}  {v}" for k, v in costs]
    acts = report["activations"]
    if acts:
        lines += ["", "activations (claim -> ready, the agent's stages; times from the pulse start):"]
        head = ("node/slot", "path", "claimed", "claim->ready", "token", "load", "engine", "readiness", "agent total")
        body = [
            (
                f"{x['node']}/{x['slot']}",
                x["path"],
                f"{x['claimed_at_s']:+.2f} s",
                _fmt_ms(x["claim_to_ready_ms"]),
                *(_fmt_ms(x["stages_ms"].get(s)) for s in STAGES),
            )
            for x in acts
        ]
        w2 = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines.append("  ".join(c.ljust(w) for c, w in zip(head, w2, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, w2, strict=True)).rstrip() for r in body]
    start = report["pulse"]["start_s"]
    for req in report["cold_path"]["requests"]:
        if req["at_s"] >= -start:  # asked while the load ran (before it: the pool was still staging)
            lines.append(f"cold path at {req['at_s']:+.2f} s: {req['replicas']} more replica(s) asked for")
    for node, took in report["cold_path"]["node_start_to_warm_s"].items():
        lines.append(f"cold path: {node} started from nothing, warm after {took:.2f} s")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _fmt_lat(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1e3:.2f} s" if ms >= 1000 else _fmt_ms(ms)


def _lat(x: dict[str, Any]) -> str:
    return f"p50 {_fmt_lat(x['p50'])}, p99 {_fmt_lat(x['p99'])}, max {_fmt_lat(x['max'])} ({x['requests']:,} requests)"


def _statuses(report: dict[str, Any]) -> str:
    statuses: dict[str, int] = report["responses_by_status"]
    ended = sum(statuses.values())
    others = {k: n for k, n in statuses.items() if k != "200"}
    if not others:
        return f"none: all {ended:,} answered 200" if ended else "none (no request ended)"
    named = ", ".join(f"{k.replace('_', ' ')} x{n:,}" for k, n in others.items())
    return f"{sum(others.values()):,} of {ended:,}: {named}"


def cost_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, this run) rows of what the pulse cost; none for a report without them (an older report.json)."""
    if "responses_by_status" not in report:
        return []
    lat = report["latency_ms"]
    rs = report["replicas"]
    base = report["base"]
    cold = report["cold_path"]
    most = cold["most_replicas_in_one_ask"]
    after = report["after_pulse"]
    ratio = "" if rs["ratio"] is None else f" ({rs['ratio']:.2f}x)"
    rows = [
        ("request latency in the pulse", _lat(lat["pulse"])),
        (
            "request latency, whole run",
            _lat(lat["overall"]) + f"; worst second's p99 {_fmt_lat(lat['p99_worst_second'])}",
        ),
        ("answers other than 200", _statuses(report)),
        (
            "replica-seconds (serving)",
            f"{rs['replica_seconds']:,.1f} for {rs['needed_replica_seconds']:,.1f} needed{ratio}; peak "
            f"{rs['peak_replicas']} serving, needed peak {rs['needed_peak_replicas']} "
            f"(at {rs['capacity_rps_per_replica']:g} req/s each)",
        ),
        (
            "base (before the pulse)",
            f"{base['replicas']} replicas at most (mean {base['replicas_mean']:g}); its {base['offered_rps']:g} req/s "
            f"need {base['needed_replicas']} at {base['utilisation'] * 100:.0f} % use "
            f"({base['needed_at_full_use']} at full use)",
        ),
        (
            "cold path asks",
            f"before the load {cold['before_load']}, base {cold['during_base']}, pulse {cold['during_pulse']}"
            + (f" (up to {most['pulse']} replicas)" if most["pulse"] else "")
            + f", after {cold['after_pulse']}",
        ),
        (
            "after the pulse (flat load)",
            f"{after['scale_ins']} scale-in(s), {after['scale_outs']} scale-out(s); at most "
            f"{after['max_scale_ins_per_window']} scale-in(s) within one {after['stabilisation_window_s']:g} s "
            "stabilisation window",
        ),
    ]
    return rows


def _source_line(report: dict[str, Any]) -> str | None:
    """What the autoscaler scaled on, for a run not on the gateway's samples (the default says nothing)."""
    demand = report.get("demand") or {}
    if demand.get("source", "gateway") == "gateway":
        return None
    bridge = demand.get("bridge") or {}
    errors = bridge.get("errors_by_reason") or {}
    gap = demand.get("longest_gap_s")
    return (
        f"demand from {demand['source']}: pulsescale bridge read every ready engine's /metrics every "
        f"{demand.get('scrape_every_s') or 0:g} s and published {demand['samples']:,} samples (the gateway none); "
        f"longest silence {'-' if gap is None else f'{gap:.2f} s'}, samples stopped "
        f"{bridge.get('samples_stopped', '-')} time(s), bad reads "
        + (", ".join(f"{k} x{n}" for k, n in errors.items()) or "none")
    )


def _run_figures(report: dict[str, Any]) -> dict[str, Any]:
    lat = report["latency_ms"]["pulse"]
    return {
        "time_to_capacity_s": report["time_to_capacity_s"],
        "first_claim_after_pulse_s": report.get("first_claim_after_pulse_s"),
        "needed_replicas": report["needed_replicas"],
        "requests": report["requests"],
        "timeouts": report["timeouts"],
        "timeouts_during_pulse": report["timeouts_during_pulse"],
        "non_200": report["non_200"],
        "latency_pulse_ms": {k: lat[k] for k in ("p50", "p99", "max")},
        "peak_queue_depth": report["peak_queue_depth"],
        "demand_samples": (report.get("demand") or {}).get("samples"),
    }


def _p50_p99(lat: dict[str, Any]) -> str:
    return f"p50 {_fmt_lat(lat['p50'])}, p99 {_fmt_lat(lat['p99'])}"


def comparison(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """compare.json: each source's figures (its own report.json beside it) and the differences of the second from
    the first, in the order run."""
    runs = {source: _run_figures(r) for source, r in reports.items()}
    diff: dict[str, float | None] = {}
    if len(runs) == 2:
        a, b = runs.values()
        for key in ("time_to_capacity_s", "first_claim_after_pulse_s"):
            diff[key] = None if a[key] is None or b[key] is None else round(b[key] - a[key], 3)
    return {"how": COMPARED_HOW, "runs": runs, "difference": diff, "reports": {s: f"{s}/report.json" for s in runs}}


def compare_table(compared: dict[str, Any]) -> str:
    """The runs of `comparison` side by side."""
    runs: dict[str, dict[str, Any]] = compared["runs"]
    names = {"gateway": "gateway (push)", "vllm-metrics": "vllm-metrics (bridge)"}

    def row(what: str, cell: Any) -> tuple[str, ...]:
        return (what, *(cell(f) for f in runs.values()))

    rows = [
        ("demand source", *(names.get(s, s) for s in runs)),
        row("time to capacity", lambda f: _fmt_s(f["time_to_capacity_s"]) + f" ({f['needed_replicas']} replicas)"),
        row("first claim after the pulse start", lambda f: _fmt_s(f["first_claim_after_pulse_s"])),
        row("504s (during the pulse)", lambda f: f"{f['timeouts']:,} ({f['timeouts_during_pulse']:,})"),
        row("answers other than 200", lambda f: f"{f['non_200']:,} of {f['requests']:,}"),
        row("request latency in the pulse", lambda f: _p50_p99(f["latency_pulse_ms"])),
        row("deepest queue the autoscaler saw", lambda f: str(f["peak_queue_depth"])),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"demand sources side by side: {compared['how']}", ""]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    diff = compared["difference"]
    if diff.get("time_to_capacity_s") is not None or diff.get("first_claim_after_pulse_s") is not None:
        later = ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {v:+.2f} s" for k, v in diff.items() if v is not None
        )
        first, second = runs
        lines += ["", f"{second} against {first}: {later}"]
    return "\n".join(lines)
