"""Incremental housekeeping: the slot gauges' counts kept from the slot view's events equal a full scan, and
skipping the models whose decision time alone cannot change (`ModelDecider.settled`) decides exactly as re-deciding
every model every tick (the reference), on a hand clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
from hypothesis import find, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from autoscaler.daemon import Autoscaler, SlotCounts
from autoscaler.decide.decider import DeciderSettings, ModelDecider
from autoscaler.decide.policyspec import PolicySpec
from tests.autoscaler.test_autoscaler import Gateway, put_scaler, running_autoscaler
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import Override, QueueSample, ScaledObjectSpec, ScalerRecord, SlotRecord
from warmpool.registry import Changed, Removed, Snapshot

KEYS = [(m, n, s) for m in ("a", "b", "c") for n in ("n1", "n2") for s in ("s0", "s1")]
STATES = list(protocol.SLOT_STATES)


def _rec(i: int, state: str) -> SlotRecord:
    m, n, s = KEYS[i]
    return SlotRecord(model=m, node=n, slot=s, state=state)  # type: ignore[arg-type]


def _scan(records: dict[str, SlotRecord]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for r in records.values():
        out[(r.model, r.state)] = out.get((r.model, r.state), 0) + 1
    return out


step = st.one_of(
    st.tuples(st.just("put"), st.integers(0, len(KEYS) - 1), st.sampled_from(STATES)),
    st.tuples(st.just("del"), st.integers(0, len(KEYS) - 1), st.just("")),
    st.tuples(st.just("snapshot"), st.just(0), st.just("")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, max_size=60))
def test_counts_kept_from_events_equal_a_full_scan(steps: list[tuple[str, int, str]]) -> None:
    counts = SlotCounts()
    truth: dict[str, SlotRecord] = {}
    shown: dict[tuple[str, str], int] = {}  # what the gauges would read: set only for the pairs `apply` returns
    for rev, (op, i, state) in enumerate(steps, start=1):
        if op == "put":
            rec = _rec(i, state)
            truth[rec.key] = rec
            event: Snapshot[SlotRecord] | Changed[SlotRecord] | Removed = Changed(rec.key, rec, rev)
        elif op == "del":
            key = _rec(i, "warm").key
            truth.pop(key, None)
            event = Removed(key, rev)  # also for a key never seen: the view may say so after a purge
        else:
            event = Snapshot(dict(truth))
        for pair in counts.apply(event):
            shown[pair] = counts.count(*pair)
        scan = _scan(truth)
        assert counts.counts == scan
        assert {p: v for p, v in shown.items() if v} == scan


# --- skipping settled models: the same decisions as re-deciding every model every tick -------------------------


def _record(
    *,
    min_replicas: int,
    cooldown: float,
    initial_cooldown: float,
    stab: float,
    stale: float,
    stable: float,
    panic: float,
    fallback: bool,
) -> ScalerRecord:
    raw: dict[str, object] = {
        "scaleTargetRef": {"name": "m"},
        "minReplicaCount": min_replicas,
        "maxReplicaCount": 20,
        "cooldownPeriod": cooldown,
        "initialCooldownPeriod": initial_cooldown,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": "m", "targetQueueDepth": 2}}],
        "advanced": {
            "stableWindowSeconds": stable,
            "panicWindowSeconds": panic,
            "scaleDownStabilizationSeconds": stab,
            "scaleDownPeriodSeconds": 1.0,
            "staleAfterSeconds": stale,
            "leadTimeSeconds": 0.5,
        },
    }
    if fallback:
        raw["fallback"] = {"failureThreshold": 1, "replicas": 2}
    spec = protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)
    return ScalerRecord(namespace="test", name="m", spec=spec, created_at=T0)


T0 = 1_000_000.0
SETTINGS = DeciderSettings(debounce_s=0.01)  # actions are >= 0.05 s apart: every request is due at once

records = st.builds(
    _record,
    min_replicas=st.sampled_from([0, 1]),
    cooldown=st.sampled_from([0.0, 1.0, 3.0]),
    initial_cooldown=st.sampled_from([0.0, 2.0, 8.0]),  # 8 s: longer than settle_s, its countdown in reasons
    stab=st.sampled_from([0.0, 0.5, 1.0]),
    stale=st.sampled_from([0.5, 1.0, 2.0]),
    stable=st.sampled_from([1.0, 2.0]),
    panic=st.sampled_from([0.5, 1.0]),
    fallback=st.booleans(),
)
action = st.one_of(
    st.tuples(st.just("sample"), st.sampled_from(["a", "b"]), st.sampled_from([0, 0, 1, 2, 5, 9])),
    st.tuples(st.just("tick"), st.just(""), st.just(0)),
    st.tuples(st.just("tick"), st.just(""), st.just(0)),
    st.tuples(st.just("ticks"), st.just(""), st.integers(1, 40)),  # a quiet stretch: only housekeeping runs
    # A steady stretch: the gateways repeat their last word every tick (fresh, unchanged), housekeeping ticks.
    st.tuples(st.just("steady"), st.just(""), st.integers(10, 60)),
    st.tuples(st.just("steady"), st.just(""), st.integers(10, 60)),
    st.tuples(st.just("ready"), st.just(""), st.integers(0, 6)),
    st.tuples(st.just("override"), st.sampled_from(["scale", "pause", "none"]), st.integers(0, 4)),
    st.tuples(st.just("lead"), st.just(""), st.integers(1, 30)),
)


class _Pair:
    """The reference decider (re-decided every tick) and the skipping one, fed the same."""

    def __init__(self, record: ScalerRecord, held: int = 0) -> None:
        # `held`: replicas serving at the start (a restart or a takeover holds them a stable window)
        self.ref = ModelDecider(record, SETTINGS, now=T0, current_replicas=held)
        self.skip = ModelDecider(record, SETTINGS, now=T0, current_replicas=held)
        self.now, self.ready, self.seq = T0, 0, {"a": 0, "b": 0}
        self.depth: dict[str, int] = {}
        self.skipped = 0

    def _run_due(self, d: ModelDecider) -> None:
        if d.due_at is not None and d.due_at <= self.now:
            d.decide(self.now, ready=self.ready)

    def both(self) -> tuple[ModelDecider, ModelDecider]:
        return self.ref, self.skip

    def tick(self) -> None:
        self.ref.request(self.now)
        self._run_due(self.ref)
        if self.skip.settled(self.now, ready=self.ready):
            self.skip.skip(self.now)
            self.skipped += 1
        else:
            self.skip.request(self.now)
            self._run_due(self.skip)

    def sample(self, gateway: str, depth: int) -> None:
        self.seq[gateway] += 1
        self.depth[gateway] = depth
        n = self.seq[gateway]
        s = QueueSample(gateway=gateway, model="m", seq=n, ts=self.now, queue_depth=depth, inflight=0,
                        arrivals_total=n, completions_total=0, timeouts_total=0)  # fmt: skip
        for d in self.both():
            d.on_sample(s, self.now)
            self._run_due(d)

    def step(self, op: str, arg: str, n: int) -> None:
        if op in ("ticks", "steady"):
            for _ in range(n):
                self.now += 0.25
                if op == "steady":
                    for gateway, depth in self.depth.items():
                        self.sample(gateway, depth)
                    self.now += 0.05
                self.tick()
                self.check()
            return
        self.now += 0.05 if op != "tick" else 0.25
        if op == "tick":
            self.tick()
        elif op == "sample":
            self.sample(arg, n)
        elif op == "ready":
            self.ready = n  # a slot came up or went: nothing decides until the next tick or sample
        elif op == "override":
            o = None if arg == "none" else Override(kind=arg, replicas=n, expires_at=self.now + 0.6, by="t")  # type: ignore[arg-type]
            for d in self.both():
                d.override = o
                d.decide(self.now, ready=self.ready)  # `ModelController.set_override` decides at once
        else:
            for d in self.both():
                d.add_lead_time(n / 10)
        self.check()

    def check(self) -> None:
        assert self.skip.decision == self.ref.decision, f"at {self.now - T0:.2f} s"
        assert self.skip.status_row(ready=self.ready, activating=0, warm=0, stale=0, now=self.now).desired == (
            self.ref.status_row(ready=self.ready, activating=0, warm=0, stale=0, now=self.now).desired
        )


@settings(max_examples=200, deadline=None)
@given(records, st.lists(action, max_size=40), st.sampled_from([0, 0, 1, 3]))
def test_skipping_settled_models_decides_as_re_deciding_every_tick(
    record: ScalerRecord, actions: list[tuple[str, str, int]], held: int
) -> None:
    pair = _Pair(record, held)
    for op, arg, n in actions:
        pair.step(op, arg, n)


def test_the_property_draws_runs_that_skip() -> None:
    """Not vacuous: the property's own strategies produce runs in which housekeeping skips (`find` fails the test
    when none of 500 does), so the equality above is tested where it matters."""

    def skips(case: tuple[ScalerRecord, list[tuple[str, str, int]]]) -> bool:
        record, actions = case
        pair = _Pair(record)
        for op, arg, n in actions:
            pair.step(op, arg, n)
        return pair.skipped > 0

    find(st.tuples(records, st.lists(action, max_size=40)), skips, settings=settings(max_examples=500, deadline=None))


def test_a_quiet_model_is_skipped_until_a_gateway_turns_stale() -> None:
    rec = _record(min_replicas=1, cooldown=1.0, initial_cooldown=0.0, stab=1.0, stale=1.0, stable=1.0, panic=0.5,
                  fallback=False)  # fmt: skip
    pair = _Pair(rec)
    pair.step("ready", "", 1)  # serving: demand 2 at target 2 is no panic
    pair.step("sample", "a", 2)
    for _ in range(40):  # 10 s on a steady gateway: it samples every 0.5 s (same demand), housekeeping ticks
        pair.step("tick", "", 0)
        pair.step("sample", "a", 2)
    assert pair.skipped > 20, pair.skipped  # settled after PolicySpec.settle_s (~3.7 s here)
    before = pair.skipped
    pair.step("ticks", "", 8)  # the gateway went silent: it turns stale after 1 s, and that is decided
    assert pair.skip.decision is not None and pair.skip.decision.mode == "stale"
    assert pair.skipped < before + 8


def test_a_model_steady_from_its_first_sample_is_skipped_long_before_settle_s() -> None:
    """Windows that only ever held one demand repeat once the trend's window is full of it
    (`PolicySpec.trend_settle_s`), not `PolicySpec.settle_s` later: a fleet's models start steady, and waiting minutes
    re-decided every one of them on every turn. The skipping decider still decides as the reference does."""
    rec = _record(min_replicas=0, cooldown=1.0, initial_cooldown=0.0, stab=1.0, stale=1.0, stable=2.0, panic=0.5,
                  fallback=False)  # fmt: skip
    terms = PolicySpec.of(rec.spec)
    settle, trend = terms.settle_s, terms.trend_settle_s
    assert trend < settle / 3
    pair = _Pair(rec)
    pair.step("ticks", "", 3)  # decided blind first, as a takeover decides before the first sample comes
    pair.step("sample", "a", 0)
    pair.step("steady", "", round(settle / 0.3) - 5)  # 0.3 s a step: ends before settle_s since the first sample
    assert pair.now - T0 < settle
    assert pair.skipped > 0, "a steady model was re-decided until settle_s"
    # ...and a model whose demand once differed still waits settle_s from its last change.
    pair2 = _Pair(rec)
    pair2.step("sample", "a", 1)
    pair2.step("sample", "a", 0)
    pair2.step("steady", "", round(settle / 0.3) - 3)
    assert pair2.skipped == 0


@contextlib.asynccontextmanager
async def _four_turns(nats_server: NatsServer, nc: Client, models: list[str]) -> AsyncIterator[Autoscaler]:
    """An autoscaler for `models` whose `redecide_every_s` is four ticks long and whose ticks are the test's (its
    own would come after a minute), once every model had its first decision."""
    for m in models:
        await put_scaler(nc, m)
    async with running_autoscaler(nats_server.url, housekeeping_every_s=60.0, redecide_every_s=240.0) as scaler:
        await wait_for(lambda: len(scaler.fleet.by_model) == len(models), 5, "the models followed")
        # The takeover's first decisions (sliced over the loop) are done before the ticks are counted.
        await wait_for(lambda: all(c.decider.decision for c in scaler.fleet.by_model.values()), 5, "first decisions")
        yield scaler


async def test_each_model_is_re_decided_once_per_turn_round(nats_server: NatsServer, nc: Client) -> None:
    """`redecide_every_s` four ticks long: four turns, and each model is re-decided on exactly one of any four ticks
    in a row (time-driven decisions cost a quarter), while a sample is still decided at once. The ticks are ours
    (the daemon's own would come after a minute)."""
    models = [f"m{i}" for i in range(12)]
    async with _four_turns(nats_server, nc, models) as scaler:
        await asyncio.sleep(0.1)
        decided = {m: 0 for m in models}
        for _ in range(8):
            before = {m: scaler.fleet.by_model[m].decider._decided_at for m in models}
            await asyncio.sleep(0.06)  # past the 50 ms debounce: a tick's decision is taken at once
            await scaler.housekeeping_once()
            for m in models:
                decided[m] += scaler.fleet.by_model[m].decider._decided_at != before[m]
        assert decided == dict.fromkeys(models, 2), decided
        await Gateway(nc, "m0").send(8)
        await wait_for(lambda: scaler.fleet.by_model["m0"].decider.desired(0) == 2, 5, "the sample decided at once")


def test_a_gateway_forgotten_while_fresh_is_decided_not_skipped() -> None:
    """Housekeeping (`ModelController.housekeeping`'s `forget_after_s`) drops a gateway silent for minutes that
    still counts as fresh (a long staleAfterSeconds): the demand changed without a sample, and a model settled on
    flat windows must be decided again, not skipped on the old demand forever."""
    rec = _record(min_replicas=0, cooldown=1.0, initial_cooldown=0.0, stab=1.0, stale=1000.0, stable=1.0, panic=0.5,
                  fallback=False)  # fmt: skip
    pair = _Pair(rec)
    pair.ready = 4  # serving demand 8 at target 2: no panic
    for g in ("a", "b"):  # both before the first decision: the windows only ever hold 8
        pair.seq[g] = 1
        pair.depth[g] = 4
        s = QueueSample(gateway=g, model="m", seq=1, ts=pair.now, queue_depth=4, inflight=0, arrivals_total=1,
                        completions_total=0, timeouts_total=0)  # fmt: skip
        for d in pair.both():
            d.on_sample(s, pair.now)
    pair.step("tick", "", 0)
    pair.depth.pop("b")  # b goes silent; a keeps saying 4
    pair.step("steady", "", 20)
    assert pair.skipped > 0, "settled on the flat windows"
    for d in pair.both():
        assert d.demand.forget_stale(pair.now, 2.0) == 1  # b, silent for ~6 s
        d.touch(pair.now)
    assert not pair.skip.settled(pair.now, ready=pair.ready)
    pair.step("ticks", "", 4)  # re-decided on the demand left (a's 4), as the reference is
    assert pair.skip.decision is not None and pair.skip.decision.stable_demand is not None
    assert pair.skip.decision.stable_demand < 8


async def test_between_its_turns_a_model_is_looked_at_only_while_it_needs_it(
    nats_server: NatsServer, nc: Client
) -> None:
    """Off its turn, housekeeping passes a model by unless it holds slots or found its pool empty: an empty pool
    is looked at again on the next tick (`ModelScaler.housekeeping` clears `exhausted` as it looks)."""
    models = [f"m{i}" for i in range(8)]
    async with _four_turns(nats_server, nc, models) as scaler:
        turn = (scaler._tick + 1) % 4  # the next tick's
        off = [scaler.fleet.by_model[m] for m in models if protocol.shard_of(m, 4) != turn]
        assert len(off) >= 2
        looked, passed = off[0], off[1]
        looked.scaler.exhausted = True
        assert looked.housekeeping_due(False) and not passed.housekeeping_due(False)
        before = passed.decider._decided_at
        await scaler.housekeeping_once()
        assert not looked.scaler.exhausted, "an exhausted pool off its turn was not looked at again"
        assert passed.decider._decided_at == before
