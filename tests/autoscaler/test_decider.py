"""The decide side on a hand clock, no broker: debounce, the lead-time p90, overrides and their expiry, the status
row. `ModelDecider` needs nothing but samples and `now`."""

from __future__ import annotations

import datetime as dt
import logging

import msgspec
import pytest

from autoscaler.decide import policy
from autoscaler.decide.decider import LEAD_TIME_MIN_SAMPLES, DeciderSettings, Evaluation, ModelDecider
from tests.helpers import HandClock
from warmpool import protocol
from warmpool.protocol import OnCallSchedule, Override, QueueSample, ScaledObjectSpec, ScalerRecord, Schedule


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


# --- settled: when housekeeping may skip a decision (each condition of `ModelDecider.settled`) ------------------------

T0 = 1_000_000.0
TICK = 0.25  # a binary fraction: hand times land exactly on the edges below


def short(
    *,
    created_at: float | None = T0,
    initial_cooldown: float = 0.0,
    schedules: tuple[Schedule, ...] = (),
    **advanced: float,
) -> ScalerRecord:
    """Short windows (PolicySpec.settle_s 3.7 s, trend_settle_s 0.7 s), target 2, at least one replica."""
    raw = {
        "schedules": [msgspec.to_builtins(s) for s in schedules],
        "scaleTargetRef": {"name": "m"},
        "minReplicaCount": 1,
        "maxReplicaCount": 20,
        "cooldownPeriod": 1.0,
        "initialCooldownPeriod": initial_cooldown,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": "m", "targetQueueDepth": 2}}],
        "advanced": {"stableWindowSeconds": 1.0, "panicWindowSeconds": 0.5, "scaleDownStabilizationSeconds": 1.0,
                     "scaleDownPeriodSeconds": 1.0, "staleAfterSeconds": 1.0, "leadTimeSeconds": 0.5, **advanced},
    }  # fmt: skip
    spec = protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)
    return ScalerRecord(namespace="test", name="m", spec=spec, created_at=created_at)


class Housekeeping:
    """Gateways repeating their demand every `TICK` on a hand clock (an unchanged sample asks for nothing), and a
    housekeeping turn after each: skip when `settled`, else decide. A second decider, `ref`, fed the same, decides
    on every turn: what skipping must leave the same."""

    def __init__(self, rec: ScalerRecord, *, ready: int = 2, current: int = 0, depth: int = 4) -> None:
        self.d = ModelDecider(rec, DeciderSettings(debounce_s=0.01), now=T0, current_replicas=current)
        self.ref = ModelDecider(rec, DeciderSettings(debounce_s=0.01), now=T0, current_replicas=current)
        self.now, self.ready = T0, ready
        self.depth = {"a": depth}
        self.seq: dict[str, int] = {}

    def sample(self, gateway: str, depth: int) -> None:
        n = self.seq[gateway] = self.seq.get(gateway, 0) + 1
        busy = n if depth else 0  # a gateway without traffic has no arrivals either
        s = QueueSample(gateway=gateway, model="m", seq=n, ts=self.now, queue_depth=depth, inflight=0,
                        arrivals_total=busy, completions_total=busy, timeouts_total=0)  # fmt: skip
        for d in (self.d, self.ref):
            d.on_sample(s, self.now)
            if d.due(self.now):
                d.decide(self.now, ready=self.ready)

    def turn(self) -> bool:
        """One housekeeping turn at `now`; whether it skipped."""
        self.ref.request(self.now)
        self.ref.decide(self.now, ready=self.ready)
        settled = self.d.settled(self.now, ready=self.ready)
        if settled:
            self.d.skip(self.now)
        else:
            self.d.request(self.now)
            self.d.decide(self.now, ready=self.ready)
        assert self.d.decision == self.ref.decision, f"at {self.now - T0} s"
        return settled

    def run(self, seconds: float) -> list[bool]:
        """`seconds` of ticks: the gateways in `depth` repeat themselves, then housekeeping takes its turn."""
        out = []
        for _ in range(round(seconds / TICK)):
            self.now += TICK
            for gateway, depth in self.depth.items():
                self.sample(gateway, depth)
            out.append(self.turn())
        return out


def test_a_steady_model_is_settled_from_its_flat_windows_on_and_stays_settled() -> None:
    """Demand 4 from the first sample: settled once the trend's window is full of it (0.7 s) and the first scale
    step's period is over (1 s), then on every turn for as long as nothing changes, the state kept as deciding
    keeps it."""
    h = Housekeeping(short())
    skipped = h.run(10.0)
    first = skipped.index(True)
    assert 1.0 <= (first + 1) * TICK <= 2.0, skipped
    assert all(skipped[first:]), skipped
    assert h.d.decision is not None and h.d.decision.desired == 2
    assert h.d.state == h.ref.state  # `skip` left the windows, the rates and the times as deciding did
    assert h.d.reason == h.ref.reason


def test_not_settled_while_a_decision_is_asked_for_or_an_override_is_set() -> None:
    h = Housekeeping(short())
    h.run(3.0)
    assert h.d.settled(h.now, ready=2)
    h.d.request(h.now)  # asked for (a sample, an edit): it is made, not skipped
    assert not h.d.settled(h.now, ready=2)
    h.d.decide(h.now, ready=2)
    assert h.d.settled(h.now, ready=2)
    h.d.override = Override(kind="scale", replicas=5, expires_at=None, by="alice")
    assert not h.d.settled(h.now, ready=2)
    h.d.override = None
    assert h.d.settled(h.now, ready=2)


def test_not_settled_on_another_ready_count_or_lead_time_than_the_last_decision_saw() -> None:
    h = Housekeeping(short())
    h.run(3.0)
    assert h.d.settled(h.now, ready=2)
    assert not h.d.settled(h.now, ready=3)
    assert not h.d.settled(h.now, ready=1)
    for seconds in (0.5, 0.6, 0.7):
        h.d.add_lead_time(seconds)
    assert h.d.lead_time_s() == 0.7
    assert not h.d.settled(h.now, ready=2)


def test_never_settled_in_a_panic() -> None:
    """Demand 8 on one ready replica (capacity 2): a panic for as long as no replica comes up; its decision is
    re-made on every turn."""
    h = Housekeeping(short(), ready=1, depth=8)
    skipped = h.run(6.0)
    assert h.d.decision is not None and h.d.decision.panic
    assert not any(skipped)


def test_never_settled_while_a_restart_holds_the_replicas_it_found() -> None:
    """A restart that finds 5 replicas serving holds them a stable window (4 s here) whatever the demand says;
    the windows are flat long before, and the hold alone keeps the model decided on every turn."""
    h = Housekeeping(short(stableWindowSeconds=4.0), ready=5, current=5)
    skipped = h.run(3.5)
    assert h.d.state.hold_replicas == 5 and not h.d.decision.panic  # type: ignore[union-attr]
    assert not any(skipped)
    assert any(h.run(10.0)), "settled once the hold is over and the replicas are scaled in"


def test_never_settled_while_a_scale_in_step_is_in_its_period() -> None:
    """Five replicas found, demand for 2: scaled in one step per period (10 s, 1 pod); within each period the step
    counts against the next, so the model is decided on every turn until the count is reached."""
    h = Housekeeping(short(scaleDownPeriodSeconds=10.0, scaleDownPods=1), ready=5, current=5)
    h.run(2.0)
    skipped = h.run(8.0)
    assert h.d.state.scale_downs and not h.d.state.scale_ups and not h.d.state.hold_replicas
    assert not any(skipped)


def test_not_settled_while_the_initial_cooldown_runs_nor_at_its_end() -> None:
    """``initialCooldownPeriod`` 2 s from the creation: its countdown is in the reasons until it ends, and its end
    is a time event (settled neither during its last second nor at its very end), then settled again."""
    h = Housekeeping(short(initial_cooldown=2.0))
    skipped = dict(zip([T0 + TICK * (i + 1) for i in range(20)], h.run(5.0), strict=True))
    assert not any(v for t, v in skipped.items() if t <= T0 + 2.0), skipped
    assert all(v for t, v in skipped.items() if t >= T0 + 2.25), skipped


def test_the_initial_cooldown_counts_from_the_creation_not_from_the_deciders_start() -> None:
    """Created 100 s before this replica took the model: its 10 s initial cooldown is long over, no time event
    is left, and the steady model settles as any other."""
    skipped = Housekeeping(short(created_at=T0 - 100.0, initial_cooldown=10.0)).run(15.0)
    assert all(skipped[8:]), skipped


def test_without_a_creation_time_the_initial_cooldown_counts_from_the_start() -> None:
    skipped = Housekeeping(short(created_at=None, initial_cooldown=2.0)).run(5.0)
    assert not any(skipped[:8]) and all(skipped[9:]), skipped


def _gateway_b(stale_after: float) -> Housekeeping:
    """a steady at 4; b said 0 once (no traffic: nothing in the rates either) at T0 + TICK and went silent."""
    h = Housekeeping(short(staleAfterSeconds=stale_after))
    h.now += TICK
    h.sample("a", 4)
    h.sample("b", 0)
    h.turn()
    return h


def test_a_gateway_turning_stale_is_a_change_decided_once() -> None:
    """b turns stale at T0 + 0.25 + 2 (stale once silent for more than staleAfterSeconds): until then the model
    is settled; at that instant b still counts (not a change yet); the turn after, it is a change, decided; then
    settled again on the windows that never held anything else."""
    h = _gateway_b(2.0)
    stale_at = T0 + TICK + 2.0
    skipped = dict(zip([h.now + TICK * (i + 1) for i in range(16)], h.run(4.0), strict=True))
    assert all(v for t, v in skipped.items() if T0 + 1.5 <= t <= stale_at), skipped
    assert not skipped[stale_at + TICK], skipped
    assert all(v for t, v in skipped.items() if t >= stale_at + 2 * TICK), skipped


def test_a_decision_at_the_instant_a_gateway_turns_stale_did_not_see_it_go() -> None:
    h = _gateway_b(2.0)
    h.run(2.0)  # to T0 + 2.25: b's last instant as fresh
    assert h.now == T0 + TICK + 2.0
    h.d.request(h.now)
    h.d.decide(h.now, ready=2)
    assert not h.d.settled(h.now + 0.01, ready=2)


def test_a_change_decided_at_its_own_instant_lets_the_flat_windows_settle() -> None:
    """Gateways forgotten (`touch`) and decided in the same instant: the decision saw the change, and the windows
    only ever held one demand, so the next turn may skip."""
    h = Housekeeping(short())
    h.run(3.0)
    h.d.touch(h.now)
    assert not h.d.settled(h.now, ready=2)
    h.d.request(h.now)
    h.d.decide(h.now, ready=2)
    assert h.d.settled(h.now + TICK, ready=2)


def test_a_new_demand_settles_when_a_decision_is_made_settle_s_after_it() -> None:
    """Windows that held two demands settle only on a decision taken `PolicySpec.settle_s` (3.7 s) or more after the
    last change: one exactly then is enough."""
    h = Housekeeping(short())
    h.run(3.0)
    h.depth["a"] = 6
    h.run(TICK)
    changed = h.now
    settle = h.d.policy_spec.settle_s
    assert settle == 3.7
    while h.now + TICK < changed + settle:
        assert not h.run(TICK)[0]
    h.now = changed + settle
    h.d.request(h.now)
    h.d.decide(h.now, ready=2)
    assert h.d.settled(h.now + 0.01, ready=2)


def test_an_edit_of_the_scaled_object_is_decided_then_settles_after_settle_s() -> None:
    h = Housekeeping(short())
    h.run(3.0)
    edited = short(stableWindowSeconds=1.5)
    for d in (h.d, h.ref):
        d.update_record(edited, h.now)
    assert not h.d.settled(h.now, ready=2)
    skipped = h.run(8.0)
    assert not any(skipped[:15]), skipped  # settle_s is 4.2 s now: the windows held the old spec's values
    assert all(skipped[-8:]), skipped


# --- the edges of on_sample, urgent and request -----------------------------------------------------------------------


def _sample(seq: int, now: float, queue: int, inflight: int = 0, gateway: str = "gw") -> QueueSample:
    return QueueSample(gateway=gateway, model="m", seq=seq, ts=now, queue_depth=queue, inflight=inflight,
                       arrivals_total=seq, completions_total=0, timeouts_total=0)  # fmt: skip


def test_the_demand_a_sample_carries_is_queue_plus_in_flight() -> None:
    """Requests move from the queue to in flight: the same total is the same demand, and asks for nothing."""
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    d.on_sample(_sample(1, T0, queue=3, inflight=1), T0)
    d.decide(T0, ready=1)
    assert d.on_sample(_sample(2, T0 + 0.1, queue=1, inflight=3), T0 + 0.1) == "accepted"
    assert d.due_at is None
    assert d.urgent(_sample(3, T0 + 0.2, queue=1, inflight=4))  # 5 > 4: a possible pulse, through in-flight too
    assert not d.urgent(_sample(3, T0 + 0.2, queue=0, inflight=4))  # 4: not above what the last decision saw
    d.on_sample(_sample(3, T0 + 0.2, queue=1, inflight=4), T0 + 0.2)
    assert d.due_at == T0 + 0.2, "rising: decided at once, inside the debounce"


def test_a_sample_below_the_peak_the_held_target_was_sized_for_waits_and_the_bar_falls_with_the_target() -> None:
    """`urgent`'s bar is the largest demand decided on since the target last fell, not the last decision's: a queue
    that wanders below a peak the held target still serves waits for the debounce (each such sample was a decision
    of its own before, `bench ingest` with demands of 0-8); once the target falls, so does the bar."""
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    d.on_sample(_sample(1, T0, queue=8), T0)
    peak = d.decide(T0, ready=0).decision.desired
    d.on_sample(_sample(2, T0 + 0.1, queue=2), T0 + 0.1)
    d.decide(T0 + 0.1, ready=peak)
    assert d.decision is not None and d.decision.desired == peak, "held: scale-down waits for its window"
    assert not d.urgent(_sample(3, T0 + 0.12, queue=6)), "6 is below the 8 the held target was sized for"
    assert not d.urgent(_sample(3, T0 + 0.12, queue=8))
    assert d.urgent(_sample(3, T0 + 0.12, queue=9)), "above the peak: a possible pulse"
    d.on_sample(_sample(3, T0 + 0.12, queue=6), T0 + 0.12)
    assert d.due_at == T0 + 0.15, "below the peak: after the debounce, not at once"
    t, seq = T0 + 0.12, 3
    while d.decision.desired >= peak and t < T0 + 3600:
        t, seq = t + 1.0, seq + 1
        d.on_sample(_sample(seq, t, queue=2), t)
        d.decide(t, ready=d.decision.desired)
    assert d.decision.desired < peak, "the scale-down came"
    assert d.urgent(_sample(seq + 1, t + 0.1, queue=6)), "the target fell: the bar is the demand it fell for"
    assert not d.urgent(_sample(seq + 1, t + 0.1, queue=2))


def test_a_sample_at_the_last_instant_its_gateway_is_fresh_is_no_change() -> None:
    """A gateway is stale once silent for more than staleAfterSeconds (1 s here): the same figure exactly 1 s
    later is the same demand, not one back from stale."""
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    d.on_sample(_sample(1, T0, queue=4), T0)
    d.decide(T0, ready=1)
    stale_after = d.demand.stale_after_s
    assert stale_after == 1.0
    d.on_sample(_sample(2, T0 + stale_after, queue=4), T0 + stale_after)
    assert d.due_at is None
    d.on_sample(_sample(3, T0 + 2 * stale_after + 0.25, queue=4), T0 + 2 * stale_after + 0.25)
    assert d.due_at is not None, "back from stale: a change"


def test_a_gateway_restart_with_a_new_demand_asks_for_a_decision() -> None:
    """A new run of a gateway (its seq starts over, later in time) is a restart: its demand counts like any other."""
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    d.on_sample(_sample(50, T0, queue=8), T0)
    d.decide(T0, ready=2)
    assert d.on_sample(_sample(1, T0 + 0.01, queue=2), T0 + 0.01) == "restart"
    assert d.due_at == T0 + 0.05, "falling: after the debounce"


def test_a_request_waits_for_the_debounce_unless_urgent_and_an_earlier_one_stands() -> None:
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    d.decide(T0, ready=0)
    assert d.request(T0 + 0.01) == T0 + 0.05
    assert d.request(T0 + 0.02) == T0 + 0.05
    assert d.request(T0 + 0.03, urgent=True) == T0 + 0.03
    assert d.request(T0 + 0.04) == T0 + 0.03, "an earlier request still pending stands"
    d.decide(T0 + 0.03, ready=0)
    assert d.request(T0 + 0.2) == T0 + 0.2, "the debounce has passed: at once"


# --- paused, the annotation's override and the status row -------------------------------------------------------------


def test_the_paused_annotation_is_an_override_in_force_by_annotation() -> None:
    d = ModelDecider(record(paused=True, paused_replicas=2), now=T0)
    d.override = Override(kind="scale", replicas=7, expires_at=None, by="bob")
    assert d.active_override(T0) == Override(kind="pause", replicas=2, expires_at=None, by="annotation")
    assert d.paused(T0)


@pytest.mark.parametrize(
    ("override", "at", "paused"),
    [
        (None, 0.0, False),
        (Override(kind="scale", replicas=3, expires_at=None, by="bob"), 0.0, False),
        (Override(kind="pause", replicas=None, expires_at=None, by="bob"), 1e9, True),
        (Override(kind="pause", replicas=2, expires_at=T0 + 5, by="bob"), 4.99, True),
        (Override(kind="pause", replicas=2, expires_at=T0 + 5, by="bob"), 5.0, False),  # expired at its end
        (Override(kind="pause", replicas=2, expires_at=T0 + 5, by="bob"), 6.0, False),
    ],
)
def test_paused_is_an_on_call_pause_in_force(override: Override | None, at: float, paused: bool) -> None:
    d = ModelDecider(record(), now=T0)
    d.override = override
    assert d.paused(T0 + at) is paused


def test_the_status_row_before_any_decision() -> None:
    d = ModelDecider(record(), now=T0)
    row = d.status_row(ready=0, activating=0, warm=2, stale=0)
    assert (row.mode, row.reason, row.panic, row.fallback, row.paused) == ("starting", "", False, False, False)
    assert (row.override, row.cold_requested, row.last_scale_at, row.last_active_at) == (None, 0, None, None)
    assert row.decisions == []


def test_the_status_row_carries_panic_override_times_and_the_cold_paths_ask() -> None:
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.0), now=T0)
    d.on_sample(_sample(1, T0 + 1, queue=40), T0 + 1)
    d.decide(T0 + 1, ready=1)  # 40 on one replica of target 4: a panic
    pause = Override(kind="pause", replicas=None, expires_at=T0 + 5, by="carol")
    d.override = pause
    row = d.status_row(ready=1, activating=3, warm=0, stale=0, cold_requested=2)
    assert row.panic and not row.fallback
    assert row.override == pause and row.paused, "judged at the last decision's time by default"
    assert not d.status_row(ready=1, activating=3, warm=0, stale=0, now=T0 + 6).paused
    assert d.status_row(ready=1, activating=3, warm=0, stale=0, now=T0 + 4).paused
    assert row.cold_requested == 2
    assert row.last_scale_at == T0 + 1, "the decision that changed the target"
    assert row.last_active_at == d.state.last_active_at == T0 + 1


def test_the_status_row_says_fallback() -> None:
    """``fallback.failureThreshold`` 0: the first missed interval of fresh demand falls back to its replicas."""
    rec = record()
    rec = msgspec.structs.replace(
        rec, spec=msgspec.structs.replace(rec.spec, fallback=protocol.Fallback(failure_threshold=0, replicas=3))
    )
    d = ModelDecider(rec, DeciderSettings(debounce_s=0.0), now=T0)
    d.on_sample(_sample(1, T0, queue=4), T0)
    d.decide(T0, ready=1)
    d.decide(T0 + 1.5, ready=1)
    assert d.decision is not None and d.decision.mode == "fallback", d.decision
    row = d.status_row(ready=1, activating=0, warm=0, stale=0)
    assert row.fallback and row.mode == "fallback" and not row.panic


# --- what a decision records ------------------------------------------------------------------------------------------


def test_a_new_decider_starts_from_no_replicas_unless_told_and_touch_needs_no_sample() -> None:
    rec = record()
    d = ModelDecider(rec, now=T0)
    assert d.state == policy.initial_state(policy.PolicySpec.of(rec.spec), now=T0, current_replicas=0)
    assert d.demand.model == "m"
    d.touch(T0 + 1)  # gateways forgotten before any sample said anything: nothing to compare yet
    assert not d.settled(T0 + 2, ready=0)


def test_only_the_newest_lead_times_are_kept() -> None:
    d = ModelDecider(record(), DeciderSettings(lead_time_samples=5), now=T0)
    for seconds in (9.0, 9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0):  # three slow activations, then five quick ones
        d.add_lead_time(seconds)
    assert d.lead_time_s() == 1.0


def test_before_any_decision_any_demand_is_urgent() -> None:
    """Nothing decided yet: a sample of any demand is above the none seen, folded in at once (`intake`)."""
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    assert d.urgent(_sample(1, T0, queue=1))
    assert not d.urgent(_sample(1, T0, queue=0))


def test_a_sample_after_a_decision_without_demand_is_decided_at_once() -> None:
    """The first decision saw no gateway (demand none, the largest single-gateway demand 0): any demand after it is
    above that, a possible pulse, decided inside the debounce."""
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.05), now=T0)
    d.decide(T0, ready=0)
    d.on_sample(_sample(1, T0 + 0.01, queue=1), T0 + 0.01)
    assert d.due_at == T0 + 0.01


def test_an_override_expires_at_its_end_and_the_log_says_whose(caplog: pytest.LogCaptureFixture) -> None:
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.0), now=T0)
    d.override = Override(kind="scale", replicas=5, expires_at=T0 + 10, by="alice")
    assert d.decide(T0 + 9.99, ready=0).decision.mode == "override"
    caplog.set_level(logging.INFO, logger="pulsescale.decider")
    ev = d.decide(T0 + 10, ready=5)
    assert ev.decision.mode != "override" and d.override is None
    assert [r.getMessage() for r in caplog.records] == ["m: override scale by alice expired; the policy resumes"]


def test_a_decision_with_an_override_in_it_is_never_repeated_by_a_skip() -> None:
    """Its reason names the override; the next decision, without it, will not: housekeeping must decide it. (The
    demand last changed more than `PolicySpec.settle_s` before: only the override stands in the way.)"""
    h = Housekeeping(short())
    h.run(5.0)
    h.d.override = Override(kind="scale", replicas=2, expires_at=None, by="alice")
    h.d.decide(h.now, ready=2)
    assert h.d.decision is not None and h.d.decision.mode == "override"
    h.d.override = None  # resumed (`pulsescale resume`)
    assert not h.d.settled(h.now + TICK, ready=2)


def test_the_scale_out_pause_reaches_the_policy() -> None:
    d = ModelDecider(record(paused_scale_out=True), DeciderSettings(debounce_s=0.0), now=T0, current_replicas=2)
    d.on_sample(_sample(1, T0, queue=40), T0)
    ev = d.decide(T0, ready=2)
    assert ev.decision.desired == 2, ev.decision


def test_last_scale_at_and_the_history_are_the_times_of_changes_only() -> None:
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.0), now=T0)
    d.on_sample(_sample(1, T0 + 1, queue=8), T0 + 1)
    d.decide(T0 + 1, ready=0)
    d.on_sample(_sample(2, T0 + 2, queue=8), T0 + 2)
    d.decide(T0 + 2, ready=2)  # the same target
    assert d.last_scale_at == T0 + 1
    assert [(r.ts, r.desired) for r in d.history] == [(T0 + 1, 2)]


def test_an_evaluation_carries_the_arrival_rate_over_the_fresh_gateways() -> None:
    d = ModelDecider(record(), DeciderSettings(debounce_s=0.0), now=T0)
    assert d.decide(T0, ready=0).arrival_rate is None
    for seq, at, arrivals in ((1, T0, 0), (2, T0 + 2, 20)):
        s = QueueSample(gateway="gw", model="m", seq=seq, ts=at, queue_depth=4, inflight=0,
                        arrivals_total=arrivals, completions_total=0, timeouts_total=0)  # fmt: skip
        d.on_sample(s, at)
    assert d.decide(T0 + 2, ready=1).arrival_rate == 10.0  # 20 requests in 2 s


def test_a_decision_that_saw_no_fresh_demand_is_never_repeated_by_a_skip() -> None:
    """Settled long ago, then the only gateway is forgotten and the model decided blind: with no demand there is
    nothing a skip could repeat (`settling.repeat` records a demand), so housekeeping decides it every turn."""
    h = Housekeeping(short(staleAfterSeconds=100.0))
    h.run(5.0)
    assert h.d.settled(h.now, ready=2)
    assert h.d.demand.forget_stale(h.now, -1.0) == 1
    h.d.request(h.now)
    ev = h.d.decide(h.now, ready=2)
    assert ev.demand is None and h.d.state.last_fresh_at == h.now  # blind, at the instant of the last fresh one
    assert not h.d.settled(h.now + TICK, ready=2)
    assert not h.d.settled(h.now + 10.0, ready=2)


# --- schedules: the floor handed to the policy, the boundaries, the status row ----------------------------------------


def at_utc(ts: float) -> str:
    """A Unix time as a schedule's UTC local start, to the second."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def sched(name: str, start: float, seconds: float, replicas: int) -> Schedule:
    return Schedule(name=name, start=at_utc(start), duration_seconds=seconds, replicas=replicas)


WARM = sched("warm", T0 + 5, 5.0, 6)  # in force for T0 + 5 <= t < T0 + 10
LATE = sched("late", T0 + 100, 10.0, 3)


def test_a_schedule_raises_the_floor_from_its_start_to_its_end_and_the_status_row_shows_it() -> None:
    d = ModelDecider(short(schedules=(LATE, WARM), staleAfterSeconds=100.0), DeciderSettings(debounce_s=0.0), now=T0)
    assert [w.name for w in d.windows] == ["warm", "late"]
    d.on_sample(_sample(1, T0 + 1, queue=4), T0 + 1)
    assert d.decide(T0 + 1, ready=2).decision.desired == 2  # demand 4 at target 2, no schedule in force yet
    row = d.status_row(ready=2, activating=0, warm=0, stale=0)
    assert row.scheduled_floor is None
    assert [(r.name, r.active) for r in row.schedules] == [("warm", False)]  # the next to start
    assert row.pool_floor == 6  # both start within the warm pool's lead time: the larger
    first = d.decide(T0 + 5, ready=2).decision  # a start is inclusive
    assert (first.desired, first.mode) == (6, "scheduled"), first
    assert first.reason.startswith("scheduled warm-up: floor 6 (policy: 2)"), first.reason
    row = d.status_row(ready=2, activating=4, warm=0, stale=0)
    assert (row.scheduled_floor, row.pool_floor) == (6, 6)
    assert [(r.name, r.active) for r in row.schedules] == [("warm", True), ("late", False)]
    assert d.status_row(ready=2, activating=4, warm=0, stale=0, now=T0 + 10).scheduled_floor is None
    assert d.decide(T0 + 9.99, ready=6).decision.mode == "scheduled"
    assert d.decide(T0 + 10, ready=6).decision.mode != "scheduled"  # an end is exclusive


def test_next_boundary_is_the_next_start_or_end_after_now() -> None:
    d = ModelDecider(short(schedules=(WARM, LATE)), now=T0)
    assert d.next_boundary(T0) == T0 + 5
    assert d.next_boundary(T0 + 5) == T0 + 10
    assert d.next_boundary(T0 + 10) == T0 + 100
    assert d.next_boundary(T0 + 110) is None
    assert ModelDecider(short(), now=T0).next_boundary(T0) is None


def test_a_schedule_starting_is_a_time_event_for_settled_up_to_its_very_instant() -> None:
    h = Housekeeping(short(schedules=(WARM,)))
    h.run(4.5)
    assert h.d.settled(h.now, ready=2)
    assert h.d.settled(T0 + 4.99, ready=2), "before the start: nothing changes"
    assert not h.d.settled(T0 + 5, ready=2), "at the start the floor changes: decided, not skipped"
    assert h.run(0.5)[-1] is False  # the turn at T0 + 5
    assert h.d.decision is not None and (h.d.decision.desired, h.d.decision.mode) == (6, "scheduled")


def test_on_call_schedules_and_an_edit_reach_the_next_decision() -> None:
    d = ModelDecider(short(), DeciderSettings(debounce_s=0.05), now=T0)
    d.on_sample(_sample(1, T0, queue=4), T0)
    assert d.decide(T0, ready=2).decision.desired == 2
    assert [w.name for w in d.windows] == []
    oncall = OnCallSchedule(schedule=sched("oc", T0, 60.0, 5), by="bob", set_at=T0)
    assert d.set_schedules((oncall,), T0 + 0.01) == T0 + 0.05  # due once the debounce has passed
    assert d.oncall_schedules == (oncall,)
    ev = d.decide(T0 + 0.05, ready=2)
    assert (ev.decision.desired, ev.decision.mode) == (5, "scheduled")
    assert [(w.name, w.source, w.by) for w in d.windows] == [("oc", "oncall", "bob")]
    edited = short(schedules=(sched("so", T0, 60.0, 7),))
    assert d.update_record(edited, T0 + 1) == T0 + 1
    assert d.decide(T0 + 1, ready=5).decision.desired == 7  # the larger of the two in force
    assert d.set_schedules((), T0 + 2) == T0 + 2
    assert [w.name for w in d.windows] == ["so"]
