"""The demo's load: the gateway package's open-loop generator (`gateway.loadgen.run_load`) with the article's
shape, and its per-second counts as the demo records them.

The generator counts each request in the second it was *sent* (its answer may come seconds later), and hands each
second over (`on_second`) once that second's sends are done; the `Second` objects it hands over keep counting the
answers as they arrive, so the totals here grow until the last answer is in.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from demo.report import LoadSecond
from gateway import loadgen

__all__ = ["LoadRun", "shape_of"]


def shape_of(
    *, base_rps: float, pulse_rps: float, duration_s: float, pulse_at_s: float, pulse_s: float, ramp_s: float
) -> loadgen.PulseShape:
    """The article's shape over `duration_s`: the base until `pulse_at_s`, the pulse for `pulse_s` (its ramp
    included), the base again for the rest."""
    ramp = min(ramp_s, pulse_s)
    return loadgen.PulseShape(
        base_rps=base_rps,
        pulse_rps=pulse_rps,
        base_s=pulse_at_s,
        ramp_s=ramp,
        hold_s=pulse_s - ramp,
        after_s=max(0.0, duration_s - pulse_at_s - pulse_s),
    )


class LoadRun:
    """One run of the generator against the gateway at `url`."""

    def __init__(
        self,
        url: str,
        model: str,
        shape: loadgen.PulseShape,
        *,
        max_tokens: int,
        timeout_s: float,
        kind: Literal["uniform", "poisson"] = "uniform",
        seed: int = 0,
    ) -> None:
        self.url = url
        self.model = model
        self.shape = shape
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.seed = seed
        self.kind: Literal["uniform", "poisson"] = kind
        self.handed: list[loadgen.Second] = []
        self.result: loadgen.LoadResult | None = None

    async def run(self, stop: asyncio.Event | None = None) -> loadgen.LoadResult:
        self.result = await loadgen.run_load(
            self.url,
            self.model,
            self.shape,
            kind=self.kind,
            seed=self.seed,
            prompt="Say something about autoscaling.",
            max_tokens=self.max_tokens,
            request_timeout_s=self.timeout_s,
            on_second=self.handed.append,
            stop=stop,
        )
        return self.result

    def _seconds(self) -> list[loadgen.Second]:
        return self.result.seconds if self.result is not None else list(self.handed)

    def seconds(self) -> list[LoadSecond]:
        """Every second handed over so far (all of them once the run is over), as the report records them."""
        out = []
        for s in self._seconds():
            lat = sorted(s.latencies_s)
            p50, p99 = loadgen.percentile(lat, 50), loadgen.percentile(lat, 99)
            out.append(
                LoadSecond(
                    t=float(s.t),
                    sent=s.sent,
                    ok=s.ok,
                    timeouts=s.timeouts_504,
                    errors=s.rejected_429 + s.other_status + s.errors,
                    p50_ms=None if p50 is None else p50 * 1e3,
                    p99_ms=None if p99 is None else p99 * 1e3,
                    rejected=s.rejected_429,
                    dropped=s.dropped,
                )
            )
        return out

    def totals(self) -> dict[str, int]:
        secs = self._seconds()
        return {
            "sent": sum(s.sent for s in secs),
            "ok": sum(s.ok for s in secs),
            "timeouts": sum(s.timeouts_504 for s in secs),
            "errors": sum(s.rejected_429 + s.other_status + s.errors for s in secs),
            "rejected_429": sum(s.rejected_429 for s in secs),
            "other_status": sum(s.other_status for s in secs),
            "connection_errors": sum(s.errors for s in secs),
            "dropped": sum(s.dropped for s in secs),
        }
