"""Scheduled warm-ups (protocol revision 8): the pure windows on a hand clock (DST included), the contract's checks,
the ScaledObject reader, the decider's floor and boundaries, the operator's pool size, and `pulsescale schedule`
end to end against a real nats-server (the command service, then the daemon keeping them across a restart)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from autoscaler.commands.service import CommandService
from autoscaler.decide import schedules
from autoscaler.decide.decider import DeciderSettings, ModelDecider
from kube import standby
from manifests import scaledobject
from oncall import verbs
from oncall.client import EXIT_REFUSED
from oncall.describe import describe_model
from pulsescale import cli as dispatcher
from tests.autoscaler.test_autoscaler import put_scaler, running_autoscaler
from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec, request, send, serving
from tests.helpers import HandClock, wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.errors import BadMessage
from warmpool.protocol import (
    OnCallSchedule,
    QueueSample,
    ScaledObjectSpec,
    ScalerRecord,
    Schedule,
    ScheduleRecord,
    StatusRow,
)
from warmpool.registry import KvSlotStore, ensure_buckets

UTC = dt.UTC


def utc(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def sched(name: str, start: str, hours: float, replicas: int, tz: str = "UTC") -> Schedule:
    return Schedule(name=name, start=start, duration_seconds=hours * 3600, replicas=replicas, timezone=tz)


def local(ts: float) -> str:
    """A Unix time as a UTC local date-time string, to the second."""
    return dt.datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S")


# --- the pure windows ----------------------------------------------------------------------------------------------

LAUNCH = sched("launch", "2026-06-01T10:00", 2, 10)
REHEARSAL = sched("rehearsal", "2026-06-01T11:00", 2, 4)  # overlaps launch: the pure module takes the max
WS = schedules.windows([LAUNCH], [OnCallSchedule(schedule=REHEARSAL, by="bob")])


@pytest.mark.parametrize(
    ("at", "floor", "boundary"),
    [
        ("2026-06-01T09:59:59", None, "2026-06-01T10:00"),
        ("2026-06-01T10:00", 10, "2026-06-01T11:00"),  # a start is inclusive
        ("2026-06-01T11:00", 10, "2026-06-01T12:00"),  # both in force: the larger floor
        ("2026-06-01T12:00", 4, "2026-06-01T13:00"),  # an end is exclusive
        ("2026-06-01T12:59:59", 4, "2026-06-01T13:00"),
        ("2026-06-01T13:00", None, None),
    ],
)
def test_floor_and_next_boundary_on_a_hand_clock(at: str, floor: int | None, boundary: str | None) -> None:
    now = utc(at)
    assert schedules.floor_at(WS, now) == floor
    assert schedules.next_boundary(WS, now) == (utc(boundary) if boundary else None)


def test_windows_name_their_source_and_rows_show_in_force_then_next() -> None:
    assert [(w.name, w.source, w.by) for w in WS] == [("launch", "scaledobject", ""), ("rehearsal", "oncall", "bob")]
    before = utc("2026-06-01T09:00")
    assert [(r.name, r.active) for r in schedules.status_rows(WS, before)] == [("launch", False)]
    during = utc("2026-06-01T11:30")
    assert [(r.name, r.active) for r in schedules.status_rows(WS, during)] == [("launch", True), ("rehearsal", True)]
    assert [r.name for r in schedules.pending_rows(WS, utc("2026-06-01T12:30"))] == ["rehearsal"]
    assert schedules.pending_rows(WS, utc("2026-06-01T13:00")) == []


@pytest.mark.parametrize(
    ("at", "floor"),
    [
        ("2026-06-01T09:49:59", None),
        ("2026-06-01T09:50", 10),  # the pool covers the floor POOL_LEAD_S (10 min) ahead of the start
        ("2026-06-01T12:30", 4),
        ("2026-06-01T13:00", None),
    ],
)
def test_the_pool_floor_starts_a_lead_time_early(at: str, floor: int | None) -> None:
    assert schedules.POOL_LEAD_S == 600
    assert schedules.pool_floor(WS, utc(at)) == floor


@pytest.mark.parametrize(
    ("start", "tz", "hours", "begins", "ends"),
    [
        # Europe/Berlin springs forward 2026-03-29 02:00 CET -> 03:00 CEST.
        ("2026-03-29T01:30", "Europe/Berlin", 1, "2026-03-29T00:30", "2026-03-29T01:30"),  # ends 03:30 CEST
        ("2026-03-29T02:30", "Europe/Berlin", 1, "2026-03-29T01:30", "2026-03-29T02:30"),  # skipped: read as CET
        ("2026-03-29T03:30", "Europe/Berlin", 1, "2026-03-29T01:30", "2026-03-29T02:30"),  # CEST, UTC+2
        # ...and falls back 2026-10-25 03:00 CEST -> 02:00 CET.
        ("2026-10-25T02:30", "Europe/Berlin", 1, "2026-10-25T00:30", "2026-10-25T01:30"),  # twice: the first
        ("2026-10-25T01:00", "Europe/Berlin", 3, "2026-10-24T23:00", "2026-10-25T02:00"),  # 3 h elapsed, 03:00 CET
        ("2026-10-25T12:00", "Europe/Berlin", 1, "2026-10-25T11:00", "2026-10-25T12:00"),  # CET, UTC+1
        # America/New_York springs forward 2026-03-08 02:00 EST -> 03:00 EDT.
        ("2026-03-08T01:00", "America/New_York", 2, "2026-03-08T06:00", "2026-03-08T08:00"),
        ("2026-12-24T18:00", "UTC", 2, "2026-12-24T18:00", "2026-12-24T20:00"),
    ],
)
def test_local_starts_across_dst_transitions(start: str, tz: str, hours: float, begins: str, ends: str) -> None:
    ws = schedules.windows([sched("s", start, hours, 3, tz)])
    assert (ws[0].starts_at, ws[0].ends_at) == (utc(begins), utc(ends))
    assert schedules.floor_at(ws, utc(begins) - 1) is None
    assert schedules.floor_at(ws, utc(begins)) == 3
    assert schedules.floor_at(ws, utc(ends)) is None


# --- the contract ----------------------------------------------------------------------------------------------


def spec_json(**over: Any) -> bytes:
    raw = {
        "scaleTargetRef": {"name": "m"},
        "maxReplicaCount": 20,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": "m"}}],
        **over,
    }
    return msgspec.json.encode(raw)


def wire(s: Schedule) -> dict[str, Any]:
    return msgspec.to_builtins(s)  # type: ignore[no-any-return]


def test_revision_8_adds_the_schedule_verb_and_fields() -> None:
    assert protocol.CONTRACT_REVISION >= 8
    assert "schedule" in protocol.CMD_VERBS and protocol.COMMAND_TYPES["schedule"] is protocol.ScheduleCommand
    assert protocol.cmd_subject("schedule") == "pulse.cmd.schedule"
    assert protocol.schedule_key("qwen") == "schedule.qwen"
    assert {"conflict", "unknown_schedule"} <= set(protocol.ERROR_CODES)
    assert wire(LAUNCH) == {
        "name": "launch", "start": "2026-06-01T10:00", "durationSeconds": 7200.0, "replicas": 10, "timezone": "UTC"
    }  # fmt: skip
    spec = protocol.decode(spec_json(schedules=[wire(LAUNCH)]), ScaledObjectSpec)
    assert spec.schedules == [LAUNCH]
    assert protocol.decode(spec_json(), ScaledObjectSpec).schedules == []  # older writers: none
    row = StatusRow(model="m", scaler="t.m", desired=1, ready=1, activating=0, warm=0)
    assert (row.scheduled_floor, row.schedules, row.pool_floor) == (None, [], None)


@pytest.mark.parametrize(
    ("schedules_", "says"),
    [
        ([wire(LAUNCH), {**wire(REHEARSAL)}], "overlap with different floors"),
        ([wire(LAUNCH), {**wire(LAUNCH), "start": "2026-07-01T00:00"}], "names must be unique"),
        ([{**wire(LAUNCH), "replicas": 21}], "over `maxReplicaCount` 20"),
        ([{**wire(LAUNCH), "durationSeconds": 7 * 86400 + 1}], "<= 604800"),
        ([{**wire(LAUNCH), "durationSeconds": 0}], "> 0"),
        ([{**wire(LAUNCH), "timezone": "Europe/Atlantis"}], "not a zone"),
        ([{**wire(LAUNCH), "timezone": "../../etc/passwd"}], "not an IANA zone name"),
        ([{**wire(LAUNCH), "start": "2026-06-01T10:00+02:00"}], "no offset"),
        ([{**wire(LAUNCH), "start": "2026-02-30T10:00"}], "not a date-time"),
        ([{**wire(LAUNCH), "name": f"s{i}", "start": f"2026-06-{i + 1:02d}T00:00"} for i in range(17)], "16"),
    ],
)
def test_bad_schedules_are_refused_by_name(schedules_: list[dict[str, Any]], says: str) -> None:
    with pytest.raises(BadMessage) as err:
        protocol.decode(spec_json(schedules=schedules_), ScaledObjectSpec)
    assert err.value.reason == "bad_value"
    assert says in str(err.value)


def test_overlapping_schedules_with_one_floor_and_touching_ones_are_admitted() -> None:
    same = {**wire(REHEARSAL), "replicas": 10}
    touching = {**wire(REHEARSAL), "name": "after", "start": "2026-06-01T12:00"}
    spec = protocol.decode(spec_json(schedules=[wire(LAUNCH), same]), ScaledObjectSpec)
    assert len(spec.schedules) == 2
    assert len(protocol.decode(spec_json(schedules=[wire(LAUNCH), touching]), ScaledObjectSpec).schedules) == 2


# --- the ScaledObject reader ---------------------------------------------------------------------------------------

MANIFEST = """
apiVersion: pulsescale.io/v1alpha1
kind: ScaledObject
metadata: {name: qwen}
spec:
  scaleTargetRef: {name: qwen}
  maxReplicaCount: 40
  triggers: [{type: gateway-queue, metadata: {model: qwen}}]
  schedules:
    - name: launch
      start: "2026-12-24T18:00"
      timezone: Europe/Berlin
      durationSeconds: 7200
      replicas: %s
"""


def test_the_reader_accepts_schedules_and_names_the_field_it_refuses() -> None:
    [m] = scaledobject.load_documents(MANIFEST % 40, source="qwen.yaml")
    assert m.record.spec.schedules[0].window()[0] == utc("2026-12-24T17:00")
    with pytest.raises(scaledobject.ScaledObjectError, match="over `maxReplicaCount` 40"):
        scaledobject.load_documents(MANIFEST % 41, source="qwen.yaml")
    with pytest.raises(scaledobject.ScaledObjectError, match=r"spec.schedules\[0\].duration: unknown field"):
        scaledobject.load_documents((MANIFEST % 4).replace("durationSeconds", "duration"), source="qwen.yaml")


def test_capping_the_replicas_cuts_the_floors_too() -> None:
    [m] = scaledobject.load_documents(MANIFEST % 40, source="qwen.yaml")
    record, cut = scaledobject.capped(m.record, 16)
    assert cut is not None and record.spec.schedules[0].replicas == 16


# --- the decider ---------------------------------------------------------------------------------------------------


def record_with(*scheds: Schedule, **advanced: float) -> ScalerRecord:
    adv = {"stableWindowSeconds": 2, "panicWindowSeconds": 1, "scaleDownStabilizationSeconds": 0,
           "scaleDownPeriodSeconds": 1, **advanced}  # fmt: skip
    raw = spec_json(schedules=[wire(s) for s in scheds], advanced=adv, minReplicaCount=1)
    return ScalerRecord(namespace="test", name="m", spec=protocol.decode(raw, ScaledObjectSpec))


class Loop:
    """One gateway sending demand 4 every 100 ms, and housekeeping every second (skip when settled)."""

    def __init__(self, decider: ModelDecider, clock: HandClock) -> None:
        self.decider, self.clock, self.seq, self.decided = decider, clock, 0, 0

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds * 10)):
            now = self.clock.advance(0.1)
            self.seq += 1
            s = QueueSample(gateway="gw", model="m", seq=self.seq, ts=now, queue_depth=4, inflight=0,
                            arrivals_total=self.seq, completions_total=self.seq, timeouts_total=0)  # fmt: skip
            self.decider.on_sample(s, now)
            if self.seq % 10 == 0:  # housekeeping's turn
                if self.decider.settled(now, ready=1):
                    self.decider.skip(now)
                else:
                    self.decider.request(now)
            if self.decider.due(now):
                self.decider.decide(now, ready=1)
                self.decided += 1


def test_the_floor_holds_from_start_to_end_and_both_are_decided_without_a_new_demand() -> None:
    clock = HandClock()
    t0 = clock()
    start = math.ceil(t0) + 30
    warm = sched("warm", local(start), 20 / 3600, 6)
    decider = ModelDecider(record_with(warm), DeciderSettings(), now=t0)
    loop = Loop(decider, clock)
    loop.run(25)
    assert decider.decision is not None and decider.decision.desired == 1
    assert decider.settled(clock(), ready=1), "steady demand: housekeeping skips the model"
    assert decider.next_boundary(clock()) == start
    assert not decider.settled(start + 0.01, ready=1), "a schedule's start is a time event"
    loop.run(6)  # past the start
    d = decider.decision
    assert (d.desired, d.mode) == (6, "scheduled") and d.reason.startswith("scheduled warm-up: floor 6 (policy: ")
    row = decider.status_row(ready=6, activating=0, warm=0, stale=0, now=clock())
    assert row.scheduled_floor == 6 and row.pool_floor == 6 and [r.name for r in row.schedules] == ["warm"]
    assert decider.next_boundary(clock()) == start + 20
    loop.run(25)  # past the end
    assert decider.decision.mode != "scheduled"
    assert decider.next_boundary(clock()) is None


def test_oncall_schedules_join_the_scaledobjects() -> None:
    clock = HandClock()
    t0 = clock()
    decider = ModelDecider(record_with(), DeciderSettings(), now=t0)
    oncall_ = OnCallSchedule(schedule=sched("oc", local(math.floor(t0)), 1, 5), by="bob", set_at=t0)
    decider.set_schedules((oncall_,), t0)
    assert decider.due(t0)
    d = decider.decide(t0, ready=0).decision
    assert (d.desired, d.mode) == (5, "scheduled")
    decider.update_record(record_with(sched("so", local(math.floor(t0)), 1, 7)), t0 + 1)
    assert decider.decide(t0 + 1, ready=5).decision.desired == 7  # the larger of the two in force


# --- the operator's warm pool ----------------------------------------------------------------------------------------


def test_the_standby_pool_covers_a_schedule_from_its_lead_time() -> None:
    body = {"spec": {"warmPool": {"size": 2}, "schedules": [wire(LAUNCH)]}}
    assert standby.pool_size(body, utc("2026-06-01T09:00")) == 2
    assert standby.pool_size(body, utc("2026-06-01T09:55")) == 10
    assert standby.pool_size(body, utc("2026-06-01T12:00")) == 2
    assert standby.pool_size(body, utc("2026-06-01T09:00"), row_pool_floor=7) == 7  # an on-call one, via status
    broken = {"spec": {"warmPool": {"size": 2}, "schedules": [{"name": "x"}]}}
    assert standby.pool_size(broken, utc("2026-06-01T10:30")) == 2


# --- `pulsescale schedule` against a real nats-server ----------------------------------------------------------------


@pytest.fixture
def control() -> ControlPlaneDouble:
    return ControlPlaneDouble({"qwen": make_spec("qwen", 1, 8)})


@pytest.fixture
async def service(nc: Client, store: KvSlotStore, control: ControlPlaneDouble) -> AsyncIterator[CommandService]:
    async with serving(nc, control, store) as svc:
        yield svc


def ahead(seconds: float) -> str:
    return local(math.floor(time.time() + seconds))


async def test_schedule_add_list_delete_and_refusals(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    launch = {"name": "launch", "start": ahead(3600), "durationSeconds": 7200, "replicas": 6}
    reply = await send(nc, "schedule", request("schedule", model="qwen", add=launch))
    assert reply["ok"] and reply["added"] == "launch"
    assert [(r["name"], r["source"], r["by"]) for r in reply["schedules"]] == [("launch", "oncall", "alice@laptop")]
    assert [o.schedule.name for o in control.schedules["qwen"]] == ["launch"]

    refused = {
        "past": ({**launch, "name": "old", "start": ahead(-7200), "durationSeconds": 60}, "out_of_bounds", "ended"),
        "over max": ({**launch, "name": "big", "start": ahead(90_000), "replicas": 9}, "out_of_bounds", "8"),
        "overlap": ({**launch, "name": "other", "replicas": 5}, "conflict", "overlap with different floors"),
        "name": ({**launch, "start": ahead(90_000)}, "conflict", "already has an on-call schedule named"),
        "far": ({**launch, "name": "far", "start": ahead(400 * 86_400)}, "out_of_bounds", "days ahead"),
        "zone": ({**launch, "name": "z", "timezone": "Mars/Base"}, "bad_value", "not a zone"),
    }
    for case, (add, code, says) in refused.items():
        reply = await send(nc, "schedule", request("schedule", model="qwen", add=add))
        assert not reply["ok"] and reply["error"]["code"] == code, (case, reply)
        assert says in reply["error"]["message"], (case, reply)
    same_floor = {**launch, "name": "extend", "start": ahead(5400)}
    assert (await send(nc, "schedule", request("schedule", model="qwen", add=same_floor)))["ok"]

    listed = await send(nc, "schedule", request("schedule", model="qwen"))
    assert [r["name"] for r in listed["schedules"]] == ["launch", "extend"]
    gone = await send(nc, "schedule", request("schedule", model="qwen", delete="launch"))
    assert gone["ok"] and gone["deleted"] == "launch" and [r["name"] for r in gone["schedules"]] == ["extend"]
    missing = await send(nc, "schedule", request("schedule", model="qwen", delete="launch"))
    assert missing["error"]["code"] == "unknown_schedule" and "extend" in missing["error"]["message"]
    unknown = await send(nc, "schedule", request("schedule", model="nope"))
    assert unknown["error"]["code"] == "unknown_model"


async def test_the_cli_adds_lists_deletes_and_status_shows_it(  # type: ignore[no-untyped-def]
    nats_server: NatsServer, service: CommandService, control: ControlPlaneDouble, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("PULSESCALE_USER", "oncall-bob")

    def main(argv: list[str]) -> int:
        try:
            return dispatcher.main(argv)
        except SystemExit as usage:  # argparse's usage errors
            return int(usage.code or 0)

    async def run(*args: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(main, ["schedule", *args, "--nats", nats_server.url])
        out = capsys.readouterr()
        return code, out.out, out.err

    at = (dt.datetime.now(UTC) + dt.timedelta(days=2)).strftime("%Y-%m-%d 18:00")
    code, out, err = await run("qwen", "--at", at, "--tz", "Europe/Berlin", "--for", "2h", "--replicas", "6")
    assert code == 0, err
    name = "at-" + at.replace(" ", "-").replace(":", "")
    assert f"qwen: schedule {name} added: floor 6 replicas from {at.replace(' ', 'T')} Europe/Berlin" in out
    assert "oncall" in out and "oncall-bob" in out
    code, out, err = await run("qwen", "--at", at, "--for", "2h", "--replicas", "9", "--name", "big")
    assert code == EXIT_REFUSED and "out_of_bounds" in err and "maxReplicaCount 8" in err
    code, out, err = await run("qwen", "--at", "2026-12-24T18:00+01:00", "--for", "2h", "--replicas", "1")
    assert code == 2 and "not a local date-time" in err
    code, out, err = await run("qwen", "--at", at, "--tz", "Nowhere/Land", "--for", "2h", "--replicas", "1")
    assert code == 2 and "not a zone" in err
    code, out, err = await run("qwen", "--at", at, "--for", "8d", "--replicas", "1")
    assert code == 2
    code, out, err = await run("qwen", "--at", at, "--for", "169h", "--replicas", "1")
    assert code == 2 and "longer than a schedule may hold" in err
    code, out, err = await run("qwen", "--list", "-o", "json")
    assert code == 0 and [r["name"] for r in json.loads(out)["schedules"]] == [name]
    code, out, err = await run("qwen", "--delete", name)
    assert code == 0 and f"schedule {name} deleted" in out and "no schedules" in out


def test_status_and_describe_show_the_schedule_in_force_and_the_next() -> None:
    now = utc("2026-06-01T11:30")
    ws = schedules.windows([LAUNCH], [OnCallSchedule(schedule=sched("later", "2026-06-02T10:00", 1, 3), by="bob")])
    row = StatusRow(model="qwen", scaler="d.qwen", desired=10, ready=10, activating=0, warm=0, mode="scheduled",
                    scheduled_floor=10, schedules=schedules.status_rows(ws, now))  # fmt: skip
    text = verbs.format_status([row], now)
    assert "SCHEDULE" in text and "launch: floor 10, 30m left" in text
    assert "launch (scaledobject): floor 10 replicas from 2026-06-01T10:00 UTC; in force until" in text
    assert "later (oncall by bob): floor 3 replicas from 2026-06-02T10:00 UTC; starts 2026-06-02T10:00:00Z" in text
    later = StatusRow(model="q2", scaler="d.q2", desired=1, ready=1, activating=0, warm=0,
                      schedules=schedules.status_rows(ws, utc("2026-06-01T13:00")))  # fmt: skip
    assert "next later: 3 in 22h" in verbs.format_status([row, later], now)
    assert "SCHEDULE" not in verbs.format_status([msgspec.structs.replace(row, schedules=[])], now)
    described = describe_model(row, now)
    assert "Scheduled floor" in described and "launch (scaledobject)" in described


# --- the daemon: stored, restored, and decided on at the boundary ---------------------------------------------------


async def test_the_daemon_stores_oncall_schedules_and_a_new_owner_restores_them(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    kept = OnCallSchedule(schedule=sched("kept", ahead(3600), 1, 2), by="carol", set_at=time.time())
    await leases.put(protocol.schedule_key("n"), protocol.encode(ScheduleRecord(model="n", schedules=[kept])))
    await leases.put(protocol.schedule_key("m"), b"{not json")
    await put_scaler(nc, "n")
    await put_scaler(nc, "m")
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(lambda: "n" in scaler.fleet.by_model and scaler.schedules_for("n") == (kept,), 5, "n's restored")
        assert scaler.schedules_for("m") == ()
        count = scaler.metrics.registry.get_sample_value
        assert count("pulsescale_registry_rejected_records_total", {"reason": "bad_json"}) == 1
        added = OnCallSchedule(schedule=sched("added", ahead(7200), 1, 2), by="dave")
        await scaler.set_schedules("m", (added,))
        stored = protocol.decode((await leases.get(protocol.schedule_key("m"))).value or b"", ScheduleRecord)
        assert stored.schedules == [added]
        await scaler.set_schedules("n", ())
        assert await scaler.stored_schedules.load() == {"m": (added,)}


async def test_a_schedule_start_is_decided_on_time_with_no_sample_and_no_housekeeping_turn(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    start = math.floor(time.time()) + 3
    soon = {"name": "soon", "start": local(start), "durationSeconds": 2, "replicas": 3}
    await put_scaler(nc, "b", schedules=[soon])
    # Housekeeping re-decides a model once a minute here: only the boundary timer can be on time.
    async with running_autoscaler(nats_server.url, redecide_every_s=60.0) as scaler:
        await wait_for(
            lambda: "b" in scaler.fleet.by_model and scaler.fleet.by_model["b"].decider.decision is not None, 5
        )
        decider = scaler.fleet.by_model["b"].decider
        await wait_for(lambda: decider.decision is not None and decider.decision.mode == "scheduled", 6, "start")
        assert time.time() - start < 1.0
        assert decider.decision.desired == 3
        rows = scaler.status("b")
        assert rows[0].scheduled_floor == 3 and rows[0].schedules[0].active
        await wait_for(lambda: decider.decision is not None and decider.decision.mode != "scheduled", 4, "end")
        assert time.time() - (start + 2) < 1.0
