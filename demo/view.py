"""The demo's live terminal view (rich), and its headless twin: one plain line per second.

Both read a `Snapshot` the run fills in every tick; neither touches NATS or a process. rich is imported here only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

__all__ = ["HeadlessView", "LiveView", "Snapshot", "View", "make_view"]


@dataclass
class Snapshot:
    """What the view shows; the run overwrites it every tick."""

    phase: str = "starting"
    t: float = 0.0
    """Seconds since the load started (negative before it)."""
    offered_rps: float = 0.0
    ok_rps: float = 0.0
    timeouts_total: int = 0
    timeouts_last_s: int = 0
    errors_total: int = 0
    queue_depth: int = 0
    inflight: int = 0
    ready: int = 0
    activating: int = 0
    warm: int = 0
    desired: int | None = None
    needed: int | None = None
    p99_ms: float | None = None
    stage_done: float = 0.0
    """Slots warm (weights staged, engine armed) of `stage_total`: the progress bar while weights stage."""
    stage_total: float = 0.0
    stage_note: str = ""
    messages: list[str] = field(default_factory=list)
    """Lines said once (the rootfs stage skipped, a cold start asked for...), newest last."""


class View(Protocol):
    def start(self) -> None: ...

    def update(self, snap: Snapshot) -> None: ...

    def say(self, text: str) -> None: ...

    def stop(self) -> None: ...


class HeadlessView:
    """A line per second (and at each phase change) for CI and logs."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self._last_line_at = -1e9
        self._phase = ""

    def start(self) -> None:
        pass

    def say(self, text: str) -> None:
        print(f"demo: {text}", file=self.out, flush=True)

    def update(self, snap: Snapshot) -> None:
        if snap.phase == self._phase and snap.t - self._last_line_at < 1.0:
            return
        self._phase, self._last_line_at = snap.phase, snap.t
        if snap.phase == "starting":
            line = "starting: nats-server, the ScaledObject, the model"
        elif snap.phase == "staging":
            line = f"{snap.phase}: {snap.stage_done:.0f}/{snap.stage_total:.0f} slots warm {snap.stage_note}".rstrip()
        else:
            line = (
                f"t={snap.t:6.1f}s {snap.phase:<8} offered {snap.offered_rps:6.1f}/s ok {snap.ok_rps:6.1f}/s "
                f"504 {snap.timeouts_total:5d} (+{snap.timeouts_last_s}) err {snap.errors_total:4d} "
                f"queue {snap.queue_depth:4d} inflight {snap.inflight:3d} replicas {snap.ready} ready "
                f"{snap.activating} activating {snap.warm} warm"
                + ("" if snap.desired is None else f" desired {snap.desired}")
                + ("" if snap.p99_ms is None else f" p99 {snap.p99_ms:.0f}ms")
            )
        print(line, file=self.out, flush=True)

    def stop(self) -> None:
        pass


class LiveView:
    """rich: a panel of the figures that matter during a pulse, and a progress bar while the weights stage."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        self.console = Console()
        self.progress = Progress(
            TextColumn("[bold]staging weights, arming engines"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[note]}"),
            console=self.console,
        )
        self.task = self.progress.add_task("stage", total=1, note="")
        self.live = Live(console=self.console, refresh_per_second=8, transient=False)
        self.snap = Snapshot()

    def start(self) -> None:
        self.live.start()

    def say(self, text: str) -> None:
        self.live.console.print(f"[dim]demo:[/] {text}")

    def update(self, snap: Snapshot) -> None:
        self.snap = snap
        self.live.update(self._render(snap))

    def _render(self, s: Snapshot) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        if s.phase in ("starting", "staging"):
            self.progress.update(self.task, total=max(1.0, s.stage_total), completed=s.stage_done, note=s.stage_note)
            return Panel(self.progress, title=f"pulsescale demo: {s.phase}")
        t = Table.grid(padding=(0, 3))
        t.add_column(justify="right", style="bold")
        t.add_column()
        t.add_column(justify="right", style="bold")
        t.add_column()
        phase_style = {"pulse": "bold red", "base": "green", "after": "cyan"}.get(s.phase, "yellow")
        t.add_row("phase", f"[{phase_style}]{s.phase}[/]", "time", f"{s.t:.1f} s")
        t.add_row("offered", f"{s.offered_rps:.0f} req/s", "served", f"{s.ok_rps:.0f} req/s")
        red = "bold red" if s.timeouts_total else "green"
        t.add_row("504s", f"[{red}]{s.timeouts_total}[/] (+{s.timeouts_last_s} last s)", "errors", str(s.errors_total))
        t.add_row("queue depth", str(s.queue_depth), "in flight", str(s.inflight))
        need = "" if s.needed is None else f" / {s.needed} needed"
        t.add_row(
            "replicas",
            f"[bold green]{s.ready}[/] ready{need}, [yellow]{s.activating}[/] activating, {s.warm} warm",
            "desired",
            "-" if s.desired is None else str(s.desired),
        )
        t.add_row("p99 latency", "-" if s.p99_ms is None else f"{s.p99_ms:.0f} ms", "", "")
        parts: list[Any] = [t]
        if s.messages:
            parts.append("\n".join(f"[dim]{m}[/]" for m in s.messages[-4:]))
        return Panel(Group(*parts), title="pulsescale demo", subtitle="Ctrl-C stops and cleans up")

    def stop(self) -> None:
        self.live.stop()


def make_view(headless: bool) -> View:
    return HeadlessView() if headless or not sys.stdout.isatty() else LiveView()
