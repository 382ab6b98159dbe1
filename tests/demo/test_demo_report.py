"""What a demo run cost, as report.json and the table print it (`demo.measures`, `demo.report`, `demo.table`), on
hand-made records; the demo's load generator against a tiny HTTP server that answers what each test says; and the
gateway's counters read back from its real Prometheus registry. The whole demo runs in tests/demo/test_demo.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from demo import measures, table
from demo import report as rep
from demo.load import LoadRun
from demo.measures import Request, Window
from demo.recorder import parse_gateway_metrics
from demo.settings import MODEL
from gateway import loadgen
from gateway.metrics import GatewayMetrics
from warmpool.protocol import Event

T0 = 1_000.0
"""Wall time of the hand-made load's t=0."""


def ev(type_: str, t: float, **kw: object) -> Event:
    """An event `t` seconds after the load's t=0."""
    return Event(type=type_, model=MODEL, ts=T0 + t, **kw)  # type: ignore[arg-type]


def ready(t: float, node: str) -> Event:
    return ev("slot.ready", t, node=node, slot="s0")


def released(t: float, node: str) -> Event:
    return ev("slot.released", t, node=node, slot="s0")


CONFIG = {
    "nodes": 4,
    "slots_per_node": 1,
    "pool_size": 4,
    "fleet_slots": 4,
    "base_rps": 10.0,
    "base_replicas": 1,
    "base_utilisation": 0.6,
    "pulse": 3.0,
    "pulse_s": 2.0,
    "cold_delay_s": 0.0,
    "scaled_object": {"advanced": {"scaleDownStabilizationSeconds": 4}},
}


def flat(text: str) -> str:
    """`text` with every run of whitespace one space: the table pads its columns."""
    return " ".join(text.split())


def record(requests: list[Request], events: list[Event]) -> rep.RunRecord:
    """Six seconds of load at 10 req/s, a pulse from 2 s to 4 s at 30 req/s; a replica serves 20 req/s."""
    sent = [10, 10, 30, 30, 10, 10]
    seconds = [rep.LoadSecond(t=float(t), sent=n, ok=n, timeouts=0, errors=0) for t, n in enumerate(sent)]
    return rep.RunRecord(
        load_start=T0,
        pulse_start=T0 + 2,
        pulse_end=T0 + 4,
        load_end=T0 + 8,
        offered_end=T0 + 6,
        seconds=seconds,
        events=events,
        requests=requests,
        replica_service_s=0.05,
    )


def build(requests: list[Request], events: Iterable[Event] = ()) -> dict[str, Any]:
    return rep.build_report(record(requests, list(events)), dict(CONFIG), pulse_rps=30.0, timeout_s=5.0)


# --- answers and latency ------------------------------------------------------------------------------------------


def test_the_table_names_every_answer_other_than_200_when_no_504_hides_it() -> None:
    """The SRE's run: 0 504s, one error, and a table that said "0 in all". Every non-200 is named now, with its
    status, and counted apart from the 504s."""
    reqs = [Request(0.1 * i, 0.1 * i + 0.05, 200) for i in range(20)]
    reqs += [Request(2.5, 2.6, 502), Request(3.0, 3.0, None, measures.CONNECTION_ERROR), Request(3.1, 3.2, 503)]
    r = build(reqs)
    assert r["responses_by_status"] == {"200": 20, "502": 1, "503": 1, "connection_error": 1}
    assert r["non_200"] == 3
    text = table.article_table(r)
    assert "answers other than 200 3 of 23: 502 x1, 503 x1, connection error x1" in flat(text), text
    assert "none: all" not in text


def test_a_run_without_errors_says_so_and_counts_what_ended() -> None:
    r = build([Request(0.1 * i, 0.1 * i + 0.05, 200) for i in range(10)])
    assert r["non_200"] == 0
    assert "none: all 10 answered 200" in table.article_table(r)


def test_latency_by_phase_counts_every_answer_504s_included() -> None:
    """A 504 is 5 s of a client's wait: it is in the latency (by send time), the 200s alone are apart."""
    reqs = [Request(0.5, 0.55, 200), Request(1.5, 1.56, 200)]  # base
    reqs += [Request(2.0 + 0.01 * i, 2.1 + 0.01 * i, 200) for i in range(98)]  # pulse: 100 ms each...
    reqs += [Request(3.0, 8.0, 504), Request(3.5, 8.5, 504)]  # ...and two that timed out
    reqs += [Request(5.0, 5.07, 200)]  # after
    r = build(reqs)
    lat = r["latency_ms"]
    assert lat["base"] == {"requests": 2, "p50": 50.0, "p99": 60.0, "max": 60.0}
    assert lat["pulse"]["requests"] == 100 and lat["pulse"]["p50"] == 100.0
    assert lat["pulse"]["p99"] == 5000.0 and lat["pulse"]["max"] == 5000.0
    assert lat["after"]["requests"] == 1 and lat["overall"]["requests"] == 103
    assert r["latency_ok_ms"]["pulse"] == {"requests": 98, "p50": 100.0, "p99": 100.0, "max": 100.0}
    assert "request latency in the pulse p50 100 ms, p99 5.00 s, max 5.00 s (100 requests)" in flat(
        table.article_table(r)
    )


# --- replicas -----------------------------------------------------------------------------------------------------


def test_replica_seconds_integrate_the_serving_replicas_against_each_seconds_need() -> None:
    """Serving: 1 from before the load, 2 at 2.5 s, 1 at 4.5 s (a release). Needed at 20 req/s each: 1, 1, 2, 2, 1,
    1 (ceil(sent / 20))."""
    events = [ready(-3, "n1"), ready(2.5, "n2"), released(4.5, "n2")]
    r = build([], events)
    rs = r["replicas"]
    assert rs["replica_seconds"] == pytest.approx(1 * 6 + 1 * 2.0)  # the second replica served 2.5 -> 4.5
    assert rs["needed_replica_seconds"] == 8.0
    assert rs["ratio"] == 1.0
    assert (rs["peak_replicas"], rs["needed_peak_replicas"]) == (2, 2)
    assert [s["needed"] for s in r["series"]] == [1, 1, 2, 2, 1, 1]


def test_the_base_phase_counts_the_most_replicas_held_against_the_bases_need() -> None:
    """10 req/s at 60 % of 20 req/s per replica needs 1; the autoscaler held 2 for a second of the base."""
    events = [ready(-3, "n1"), ready(0.5, "n2"), released(1.5, "n2")]
    base = build([], events)["base"]
    assert base["replicas"] == 2 and base["needed_replicas"] == 1 and base["needed_at_full_use"] == 1
    assert base["replicas_mean"] == 1.5 and base["offered_rps"] == 10.0


@pytest.mark.parametrize(
    ("rps", "capacity", "utilisation", "expected"),
    [(0, 20, 1.0, 0), (20, 20, 1.0, 1), (20.5, 20, 1.0, 2), (20, 20, 0.6, 2), (12, 20, 0.6, 1), (5, 0, 1.0, 0)],
)
def test_needed_for(rps: float, capacity: float, utilisation: float, expected: int) -> None:
    assert measures.needed_for(rps, capacity, utilisation) == expected


# --- the autoscaler's asks and steps ------------------------------------------------------------------------------


def test_cold_path_asks_are_counted_by_phase() -> None:
    events = [
        ev("cold.start", -5, desired=2),  # before any load: the pool was still staging
        ev("cold.start", 2.2, desired=3),
        ev("cold.start", 2.8, desired=1),
        ev("cold.start", 4.0, desired=1),  # the pulse's end belongs to after
    ]
    cold = build([], events)["cold_path"]
    assert (cold["before_load"], cold["during_base"], cold["during_pulse"], cold["after_pulse"]) == (1, 0, 2, 1)
    assert cold["most_replicas_in_one_ask"] == {"before_load": 2, "base": 0, "pulse": 3, "after": 1}
    assert [x["phase"] for x in cold["requests"]] == ["before_load", "pulse", "pulse", "after"]
    text = table.article_table(build([], events))
    assert "cold path asks before the load 1, base 0, pulse 2 (up to 3 replicas), after 1" in flat(text), text


def test_steps_after_the_pulse_and_the_most_scale_ins_in_one_stabilisation_window() -> None:
    """4 -> 3 -> 2 within 0.5 s, a scale-out, 3 -> 2 again 1.7 s after the first: three scale-ins and one scale-out
    in one 4 s window; with a 1 s window, two at most and the last in the second window. A decision before the
    pulse's end sets where the steps start; one past the offered load is not on the flat load."""
    events = [
        ev("scale.decision", 2.1, desired=4),
        ev("scale.decision", 4.2, desired=3),
        ev("scale.decision", 4.7, desired=2),
        ev("scale.decision", 5.0, desired=3),
        ev("scale.decision", 5.9, desired=2),
        ev("scale.decision", 6.5, desired=1),  # past the offered load: not on the flat load
    ]
    after = measures.after_pulse(events, T0, Window(4.0, 6.0), 4.0, desired_before=1)
    assert [(s["from"], s["to"], s["kind"], s["window"]) for s in after["steps"]] == [
        (4, 3, "in", 0),
        (3, 2, "in", 0),
        (2, 3, "out", 0),
        (3, 2, "in", 0),
    ]
    assert (after["scale_ins"], after["scale_outs"], after["max_scale_ins_per_window"]) == (3, 1, 3)
    narrow = measures.after_pulse(events, T0, Window(4.0, 6.0), 1.0, desired_before=1)
    assert narrow["max_scale_ins_per_window"] == 2 and [s["window"] for s in narrow["steps"]] == [0, 0, 0, 1]


def test_the_report_reads_the_stabilisation_window_from_the_scaled_object() -> None:
    after = build([], [ev("scale.decision", 4.5, desired=1)])["after_pulse"]
    assert after["stabilisation_window_s"] == 4.0
    assert after["steps"] == []  # 1 -> 1: the base's replicas, no step
    assert json.loads(json.dumps(after)) == after


# --- the gateway's counters ---------------------------------------------------------------------------------------


def test_the_gateways_counters_read_back_from_its_own_registry() -> None:
    m = GatewayMetrics(CollectorRegistry())
    for code, n in (("200", 5), ("504", 2), ("429", 1)):
        for _ in range(n):
            m.responses.labels(MODEL, code).inc()
    m.responses.labels("other-model", "502").inc()
    for s in (0.04, 0.06, 0.07, 3.0):
        m.request_seconds.labels(MODEL).observe(s)
    got = parse_gateway_metrics(generate_latest(m.registry).decode(), MODEL)
    assert got["responses_by_status"] == {"200": 5, "429": 1, "504": 2}
    hist = got["request_seconds"]
    assert hist["count"] == 4 and hist["sum"] == pytest.approx(3.17)
    assert dict((le, n) for le, n in hist["buckets"])[0.05] == 1
    assert dict((le, n) for le, n in hist["buckets"])[0.1] == 3
    assert hist["buckets"][-1] == [60.0, 4]  # +Inf is the count


# --- the load generator: every request, its status and when it completed ------------------------------------------


@pytest.fixture(name="answers")
async def answers_fixture() -> AsyncIterator[tuple[str, list[int]]]:
    """A server answering `POST /v1/completions` with each status of the list in turn (0: drop the connection)."""
    statuses: list[int] = []
    seen = [0]

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        status = statuses[seen[0] % len(statuses)]
        seen[0] += 1
        if status == 0:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        await asyncio.sleep(0.02)
        return web.Response(status=status, text="{}")

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", statuses
    finally:
        await runner.cleanup()


async def test_the_load_keeps_every_status_apart_and_counts_200s_by_completion(
    answers: tuple[str, list[int]],
) -> None:
    url, statuses = answers
    statuses += [200, 200, 502, 200, 0]
    shape = loadgen.PulseShape(base_rps=20, pulse_rps=20, base_s=1.0, ramp_s=0, hold_s=0, after_s=0)
    run = LoadRun(url, MODEL, shape, max_tokens=1, timeout_s=2)
    await run.run()
    got = measures.by_status(run.requests)
    assert got == {"200": 12, "502": 4, "connection_error": 4}, got
    totals = run.totals()
    assert totals["sent"] == 20 == totals["ended"] and totals["ok"] == 12 and totals["errors"] == 8
    assert totals["connection_errors"] == 4 and totals["other_status"] == 4
    secs = run.seconds()
    assert sum(s.sent for s in secs) == 20 and sum(s.served for s in secs) == 12
    assert all(s.ok + s.timeouts + s.errors == s.sent for s in secs), secs  # each request in its send second
    assert all(r.latency_s >= 0.02 for r in run.requests if r.status is not None)
