"""The demo's load: an open-loop generator with the article's shape (the gateway package's pure `PulseShape` and
`arrivals`), keeping every request it sent as a `demo.measures.Request` (sent, ended, HTTP status or why none).

Open loop, as `gateway.loadgen.run_load`: each request is sent on a schedule fixed before the run, never waiting for
earlier answers. The demo keeps each request rather than per-second counts: its report needs every status apart
(a 502 is not a 504), latencies of every answer (a 504 is 5 s of a client's wait) and when each 200 completed (the
served rate, which no replica count can exceed), none of which `run_load`'s per-second counts keep.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Literal

import aiohttp

from demo.measures import CLIENT_TIMEOUT, CONNECTION_ERROR, Request
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
    """One run of the load against the gateway at `url`: `run` sends it; `requests` holds every request that has
    ended, `sent` and `dropped` count by send second."""

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
        max_outstanding: int = 10_000,
    ) -> None:
        self.url = url
        self.model = model
        self.shape = shape
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.seed = seed
        self.kind: Literal["uniform", "poisson"] = kind
        self.max_outstanding = max_outstanding
        """The generator's own limit of requests awaiting answers; beyond it a request is `dropped`, not sent."""
        n = max(1, math.ceil(shape.duration_s))
        self.sent = [0] * n
        self.dropped = [0] * n
        self.requests: list[Request] = []
        self.started_at: float | None = None
        """Wall time (Unix s) of t=0."""
        self.sending_done = False
        self._t0: float | None = None

    def elapsed(self) -> float:
        """Seconds since t=0 (0 before the run)."""
        return 0.0 if self._t0 is None else asyncio.get_running_loop().time() - self._t0

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Send the shape's requests and wait for every answer (each bounded by `timeout_s`); `stop` ends the
        sending early."""
        times = loadgen.arrivals(self.shape, kind=self.kind, seed=self.seed)
        body = json.dumps(
            {"model": self.model, "prompt": "Say something about autoscaling.", "max_tokens": self.max_tokens}
        ).encode()
        headers = {"Content-Type": "application/json"}
        target = self.url.rstrip("/") + "/v1/completions"
        loop = asyncio.get_running_loop()
        outstanding: set[asyncio.Task[None]] = set()

        async def one(sent_s: float, session: aiohttp.ClientSession, t0: float) -> None:
            status: int | None = None
            error: str | None = None
            try:
                async with session.post(target, data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
            except TimeoutError:
                error = CLIENT_TIMEOUT
            except (aiohttp.ClientError, OSError):
                error = CONNECTION_ERROR
            self.requests.append(Request(sent_s, loop.time() - t0, status, error))

        connector = aiohttp.TCPConnector(limit=self.max_outstanding)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.started_at, t0 = time.time(), loop.time()
            self._t0 = t0
            for at in times:
                if stop is not None and stop.is_set():
                    break
                delay = t0 + at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                # Counted in the second it went out (a late send's second, not its schedule's): as `seconds` groups.
                sent_s = loop.time() - t0
                sec = min(int(sent_s), len(self.sent) - 1)
                if len(outstanding) >= self.max_outstanding:
                    self.dropped[sec] += 1
                    continue
                self.sent[sec] += 1
                task = asyncio.create_task(one(sent_s, session, t0))
                outstanding.add(task)
                task.add_done_callback(outstanding.discard)
            self.sending_done = True
            if outstanding:
                await asyncio.wait(set(outstanding))

    def seconds(self) -> list[LoadSecond]:
        """Every second whose sends are done (all of them once the run is over, and the seconds after the load
        while answers still complete), as the report records them: counts and latency by send second, the 200s
        also by the second they completed in."""
        if self.started_at is None:
            return []
        if self.sending_done:
            last_done = max((r.done_s for r in self.requests), default=0.0)
            n = max(len(self.sent), math.floor(last_done) + 1)
        else:
            n = min(len(self.sent), math.floor(self.elapsed()))
        by_send: list[list[Request]] = [[] for _ in range(n)]
        served = [0] * n
        for r in self.requests:
            s = min(int(r.sent_s), len(self.sent) - 1)
            if s < n:
                by_send[s].append(r)
            if r.status == 200 and int(r.done_s) < n:
                served[int(r.done_s)] += 1
        out = []
        for t in range(n):
            rs = by_send[t]
            lat = sorted(r.latency_s for r in rs)
            p50, p99 = loadgen.percentile(lat, 50), loadgen.percentile(lat, 99)
            out.append(
                LoadSecond(
                    t=float(t),
                    sent=self.sent[t] if t < len(self.sent) else 0,
                    ok=sum(1 for r in rs if r.status == 200),
                    timeouts=sum(1 for r in rs if r.status == 504),
                    errors=sum(1 for r in rs if r.status not in (200, 504)),
                    p50_ms=None if p50 is None else p50 * 1e3,
                    p99_ms=None if p99 is None else p99 * 1e3,
                    rejected=sum(1 for r in rs if r.status == 429),
                    dropped=self.dropped[t] if t < len(self.dropped) else 0,
                    served=served[t],
                )
            )
        return out

    def totals(self) -> dict[str, int]:
        """Requests sent, and of those ended: 200s, 504s, other errors (429s, other statuses, no answer)."""
        rs = self.requests
        return {
            "sent": sum(self.sent),
            "ended": len(rs),
            "ok": sum(1 for r in rs if r.status == 200),
            "timeouts": sum(1 for r in rs if r.status == 504),
            "errors": sum(1 for r in rs if r.status not in (200, 504)),
            "rejected_429": sum(1 for r in rs if r.status == 429),
            "other_status": sum(1 for r in rs if r.status is not None and r.status not in (200, 429, 504)),
            "connection_errors": sum(1 for r in rs if r.status is None),
            "dropped": sum(self.dropped),
        }
