"""The decide side on a hand clock, no broker: debounce, the lead-time p90, overrides and their expiry, the status
row. `ModelDecider` needs nothing but samples and `now`."""

from __future__ import annotations

import msgspec
import pytest

from autoscaler.decider import LEAD_TIME_MIN_SAMPLES, DeciderSettings, Evaluation, ModelDecider
from tests.helpers import HandClock
from warmpool import protocol
from warmpool.protocol import Override, QueueSample, ScaledObjectSpec, ScalerRecord


def record(**over: object) -> ScalerRecord:
    raw = {
        "scaleTargetRef": {"name": "m"},
        "minReplicaCount": 0,
        "maxReplicaCount": 20,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": "m", "targetQueueDepth": 4}}],
    }
    spec = protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)
    return ScalerRecord(namespace="test", name="m", spec=spec, **over)  # type: ignore[arg-type]


class Feed:
    """One gateway's samples into a decider, and every decision that came due, on a hand clock."""

    def __init__(self, decider: ModelDecider, clock: HandClock) -> None:
        self.decider, self.clock, self.seq = decider, clock, 0
        self.ready = 0
        self.evaluations: list[Evaluation] = []

    def sample(self, depth: int) -> None:
        self.seq += 1
        now = self.clock()
        s = QueueSample(gateway="gw", model="m", seq=self.seq, ts=now, queue_depth=depth, inflight=0,
                        arrivals_total=self.seq, completions_total=0, timeouts_total=0)  # fmt: skip
        assert self.decider.on_sample(s, now) == "accepted"
        self.tick()

    def tick(self) -> None:
        """What the controller's timer does: decide when a decision is due."""
        if self.decider.due(self.clock()):
            self.evaluations.append(self.decider.decide(self.clock(), ready=self.ready))


def test_a_burst_of_samples_is_one_decision_and_rising_demand_decides_at_once() -> None:
    clock = HandClock()
    t0 = clock()
    feed = Feed(ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=t0), clock)
    feed.sample(4)
    assert len(feed.evaluations) == 1, "the first sample (demand rising from nothing) is decided at once"
    assert feed.evaluations[0].sample_at == t0
    burst_start = clock.advance(0.001)
    for i in range(10):  # demand moving below the last decision's, 10 samples within the debounce
        feed.sample(3 - i % 2)
        clock.advance(0.004)
    assert len(feed.evaluations) == 1, "falling samples inside the debounce decide nothing yet"
    assert feed.decider.due_at == pytest.approx(t0 + 0.05)
    clock.advance(0.05 - (clock() - t0))
    feed.tick()
    assert len(feed.evaluations) == 2, "the whole burst is one decision, when the debounce has passed"
    assert feed.evaluations[1].sample_at == burst_start, "timed from the first sample of the burst"
    clock.advance(0.001)
    feed.sample(12)  # rising: a possible pulse, decided although the debounce has not passed
    assert len(feed.evaluations) == 3
    assert feed.evaluations[2].decision.desired == 3
    clock.advance(0.001)
    feed.sample(6)  # falling: waits for the debounce
    assert len(feed.evaluations) == 3
    feed.tick()
    assert len(feed.evaluations) == 3


def test_a_sample_that_does_not_change_the_demand_asks_for_no_decision() -> None:
    clock = HandClock()
    feed = Feed(ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=clock()), clock)
    feed.sample(4)
    assert len(feed.evaluations) == 1
    for _ in range(20):  # flat demand at the gateways' pace, well past the debounce
        clock.advance(0.1)
        feed.sample(4)
        assert feed.decider.due_at is None, "an unchanged sample asks for nothing: time is housekeeping's"
    assert len(feed.evaluations) == 1
    feed.decider.request(clock())  # housekeeping's periodic re-decision still decides
    feed.tick()
    assert len(feed.evaluations) == 2 and feed.evaluations[1].sample_at is None
    clock.advance(0.1)
    feed.sample(2)  # falling: a change, decided after the debounce (which has passed)
    assert len(feed.evaluations) == 3 and feed.evaluations[2].sample_at == clock()


def test_a_gateway_back_from_stale_with_the_same_demand_is_a_change() -> None:
    clock = HandClock()
    decider = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=clock())
    feed = Feed(decider, clock)
    feed.sample(4)
    clock.advance(decider.demand.stale_after_s + 1)  # silent: its demand no longer counts
    feed.decider.request(clock())
    feed.tick()
    assert feed.evaluations[-1].demand is None
    clock.advance(0.1)
    feed.sample(4)
    assert feed.evaluations[-1].demand == 4, "the same figure from a gateway that was stale changes the demand"


def test_no_decision_is_due_without_a_sample_or_a_request() -> None:
    clock = HandClock()
    decider = ModelDecider(record(), now=clock())
    assert decider.due_at is None and not decider.due(clock.advance(10))
    assert decider.request(clock()) == clock() and decider.due(clock())
    ev = decider.decide(clock(), ready=0)
    assert ev.sample_at is None, "a decision no sample caused starts no decision-latency measurement"


def test_lead_time_is_none_until_three_measurements_then_their_p90() -> None:
    clock = HandClock()
    decider = ModelDecider(record(), now=clock())
    assert LEAD_TIME_MIN_SAMPLES == 3
    decider.add_lead_time(0.4)
    decider.add_lead_time(0.2)
    assert decider.lead_time_s() is None
    decider.add_lead_time(0.3)
    assert decider.lead_time_s() == 0.4
    for seconds in (0.1, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):  # ten measurements 0.1 .. 1.0
        decider.add_lead_time(seconds)
    assert decider.lead_time_s() == 0.9, "nine in ten at or below it"
    decider.add_lead_time(5.0)  # one slow outlier of eleven moves the p90 to the next rank, not to the outlier
    assert decider.lead_time_s() == 1.0


def test_the_measured_lead_time_is_what_the_forecast_looks_ahead_by() -> None:
    clock = HandClock()
    feed = Feed(ModelDecider(record(), now=clock()), clock)
    for seconds in (1.2, 1.3, 1.4):
        feed.decider.add_lead_time(seconds)
    feed.ready = 1  # demand 6 on one ready replica is not a panic (2 x 4): the normal, forecasting path
    feed.sample(6)
    reason = feed.evaluations[-1].decision.reason
    assert " in 1.4 s " in reason, reason


def test_an_override_beats_the_policy_until_it_expires_then_the_reason_says_the_policy_resumed() -> None:
    clock = HandClock()
    feed = Feed(ModelDecider(record(), now=clock()), clock)
    feed.decider.override = Override(kind="scale", replicas=5, expires_at=clock() + 10, by="alice")
    feed.sample(4)
    first = feed.evaluations[-1]
    assert (first.decision.desired, first.decision.mode) == (5, "override")
    clock.advance(9.9)
    feed.decider.request(clock())
    feed.tick()
    assert feed.evaluations[-1].decision.desired == 5
    clock.advance(0.2)  # past the expiry
    feed.decider.request(clock())
    feed.tick()
    resumed = feed.evaluations[-1]
    assert "override scale=5 by alice expired, policy resumed" in resumed.decision.reason
    assert resumed.decision.mode != "override" and resumed.changed
    assert feed.decider.override is None, "forgotten once the resumption was decided"
    clock.advance(0.1)
    feed.decider.request(clock())
    feed.tick()
    assert "expired" not in feed.evaluations[-1].decision.reason


def test_the_paused_annotation_holds_the_count_and_beats_an_on_call_override() -> None:
    clock = HandClock()
    feed = Feed(ModelDecider(record(paused=True, paused_replicas=2), now=clock()), clock)
    feed.decider.override = Override(kind="scale", replicas=7, expires_at=clock() + 60, by="bob")
    feed.sample(40)
    d = feed.evaluations[-1].decision
    assert (d.desired, d.mode) == (2, "paused") and "by annotation" in d.reason


def test_the_status_row_carries_the_decisions_that_changed_something() -> None:
    clock = HandClock()
    feed = Feed(ModelDecider(record(), DeciderSettings(debounce_s=0.0, decisions_kept=2), now=clock()), clock)
    assert feed.decider.status_row(ready=1, activating=2, warm=3, stale=1).desired == 3, "no decision: what is held"
    for depth in (4, 4, 8, 12):
        clock.advance(0.1)
        feed.sample(depth)
    row = feed.decider.status_row(ready=1, activating=2, warm=3, stale=1)
    assert isinstance(row, protocol.StatusRow)
    assert (row.model, row.scaler, row.ready, row.activating, row.warm, row.stale) == ("m", "test.m", 1, 2, 3, 1)
    assert row.desired == 3 and row.mode == feed.evaluations[-1].decision.mode
    assert [r.desired for r in row.decisions] == [2, 3], "newest last, at most `decisions_kept`"
    assert row.decisions[-1].reason == row.reason
