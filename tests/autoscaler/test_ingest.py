"""Folding gateway samples into demand, on a hand-advanced clock."""

from __future__ import annotations

import pytest

from autoscaler.decide.ingest import ModelDemand
from warmpool.protocol import QueueSample

T0 = 1_700_000_000.0


def s(gw: str, seq: int, ts: float, q: int = 0, inflight: int = 0, arr: int = 0, comp: int = 0) -> QueueSample:
    return QueueSample(
        gateway=gw, model="m", seq=seq, ts=ts, queue_depth=q, inflight=inflight,
        arrivals_total=arr, completions_total=comp, timeouts_total=0,
    )  # fmt: skip


def test_demand_sums_fresh_gateways_and_drops_stale_ones() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    assert d.observe(T0).demand is None  # nobody has spoken: missing, not zero
    d.add(s("a", 1, T0, q=5, inflight=2), T0)
    d.add(s("b", 1, T0, q=3, inflight=1), T0)
    o = d.observe(T0 + 0.5)
    assert o.demand == 11 and o.fresh_gateways == 2
    d.add(s("a", 2, T0 + 0.9, q=6, inflight=2), T0 + 0.9)
    o = d.observe(T0 + 1.5)  # b silent for 1.5 s: stale, leaves the sum
    assert o.demand == 8 and o.fresh_gateways == 1 and o.stale_gateways == 1
    o = d.observe(T0 + 3.0)
    assert o.demand is None and o.stale_gateways == 2


def test_rates_come_from_counter_deltas() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 1, T0, arr=100, comp=90), T0)
    assert d.observe(T0).arrival_rate is None  # one sample: no rate yet
    d.add(s("a", 2, T0 + 0.5, arr=150, comp=100), T0 + 0.5)
    d.add(s("b", 1, T0 + 0.5, arr=7), T0 + 0.5)
    d.add(s("b", 2, T0 + 0.6, arr=17), T0 + 0.6)
    o = d.observe(T0 + 0.6)
    assert o.arrival_rate == pytest.approx(200) and o.completion_rate == pytest.approx(20)


def test_duplicates_and_out_of_order_are_dropped() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    assert d.add(s("a", 5, T0, q=5, arr=10), T0) == "accepted"
    assert d.add(s("a", 5, T0, q=50, arr=10), T0 + 0.1) == "duplicate"
    assert d.add(s("a", 4, T0 - 0.1, q=40, arr=9), T0 + 0.1) == "out_of_order"
    assert d.observe(T0 + 0.1).demand == 5


def test_gateway_restart_is_not_negative_traffic() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 100, T0, q=5, arr=1000), T0)
    d.add(s("a", 101, T0 + 0.1, q=5, arr=1010), T0 + 0.1)
    assert d.observe(T0 + 0.1).arrival_rate == pytest.approx(100)
    # The gateway restarted: seq starts again, counters from zero, a newer timestamp.
    assert d.add(s("a", 1, T0 + 0.2, q=7, arr=3), T0 + 0.2) == "restart"
    o = d.observe(T0 + 0.2)
    assert o.demand == 7 and o.arrival_rate is None  # no baseline yet in the new run, never negative
    d.add(s("a", 2, T0 + 0.3, q=7, arr=13), T0 + 0.3)
    assert d.observe(T0 + 0.3).arrival_rate == pytest.approx(100)
    # A counter reset without a seq reset (seq keeps growing) is a restart too.
    assert d.add(s("a", 3, T0 + 0.4, q=1, arr=0), T0 + 0.4) == "restart"
    assert d.observe(T0 + 0.4).arrival_rate is None
    assert d.gateways["a"].restarts == 2


def test_long_gone_gateways_are_forgotten() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 1, T0), T0)
    d.add(s("b", 1, T0 + 100), T0 + 100)
    assert d.forget_stale(T0 + 200, older_than_s=150) == 1 and set(d.gateways) == {"b"}


def t(gw: str, seq: int, ts: float, *, arr: int = 0, comp: int = 0, tout: int = 0) -> QueueSample:
    """A sample that sets all three counters (the timeouts too)."""
    return QueueSample(
        gateway=gw, model="m", seq=seq, ts=ts, queue_depth=1, inflight=0,
        arrivals_total=arr, completions_total=comp, timeouts_total=tout,
    )  # fmt: skip


def test_the_next_sample_in_order_is_accepted() -> None:
    # The controller decides only on "accepted" or "restart": anything else would leave a pulse undecided.
    d = ModelDemand("m", stale_after_s=1.0)
    assert d.model == "m"
    assert d.add(s("a", 1, T0, arr=10), T0) == "accepted"
    assert d.add(s("a", 2, T0 + 0.1, arr=20), T0 + 0.1) == "accepted"
    assert d.add(s("a", 4, T0 + 0.3, arr=30), T0 + 0.3) == "accepted"  # a lost sample in between is no restart
    assert d.gateways["a"].restarts == 0


def test_unchanged_counters_are_a_rate_of_zero_not_a_restart() -> None:
    # An idle gateway repeats its counters; that is no traffic, not a new run (which would drop the baseline).
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(t("a", 1, T0, arr=50, comp=40, tout=2), T0)
    assert d.add(t("a", 2, T0 + 0.5, arr=50, comp=40, tout=2), T0 + 0.5) == "accepted"
    o = d.observe(T0 + 0.5)
    assert o.arrival_rate == 0.0 and o.completion_rate == 0.0
    assert d.gateways["a"].restarts == 0


@pytest.mark.parametrize(
    ("name", "comp", "tout"),
    [
        ("completions went down", 3, 2),
        ("timeouts went down", 40, 0),
        ("both went down", 3, 0),
    ],
)
def test_a_restart_seen_only_through_completions_or_timeouts(name: str, comp: int, tout: int) -> None:
    # Arrivals grew (a busy new run overtook the old count), seq grew: only the other counters tell.
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(t("a", 7, T0, arr=50, comp=40, tout=2), T0)
    assert d.add(t("a", 8, T0 + 0.1, arr=60, comp=comp, tout=tout), T0 + 0.1) == "restart", name
    assert d.observe(T0 + 0.1).arrival_rate is None, name  # no baseline in the new run: never a negative rate


def test_two_samples_with_the_same_timestamp() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 1, T0, q=2, arr=10, comp=10), T0)
    d.add(s("a", 2, T0 + 0.1, q=2, arr=20, comp=10), T0 + 0.1)
    # In order, same timestamp (two samples in one clock tick): accepted, its level used, no rate over 0 s: its
    # arrivals count over the reference interval (RATE_SPAN_S), 15 in 0.1 s.
    assert d.add(s("a", 3, T0 + 0.1, q=9, arr=25, comp=10), T0 + 0.15) == "accepted"
    o = d.observe(T0 + 0.15)
    assert o.demand == 9 and o.arrival_rate == pytest.approx(150)
    # Reordered within that tick (lower seq, same timestamp): a late packet of this run, not a new run.
    assert d.add(s("a", 2, T0 + 0.1, q=5, arr=20, comp=10), T0 + 0.16) == "out_of_order"
    assert d.gateways["a"].restarts == 0 and d.observe(T0 + 0.16).demand == 9


def test_a_repeated_seq_is_a_duplicate_whatever_it_carries() -> None:
    # seq is a sample's identity: a second copy is dropped even with another timestamp or lower counters (a new
    # run is recognised by its seq starting again, or by its next sample's counters).
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 5, T0, q=3, arr=100, comp=90), T0)
    assert d.add(s("a", 5, T0 + 0.5, q=8, arr=0, comp=0), T0 + 0.5) == "duplicate"
    assert d.gateways["a"].restarts == 0 and d.observe(T0 + 0.5).demand == 3


def test_rates_and_newest_timestamp_over_fresh_gateways() -> None:
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 1, T0 + 0.2, arr=5, comp=5), T0 + 0.2)
    o = d.observe(T0 + 0.2)
    assert o.arrival_rate is None and o.completion_rate is None  # one sample each: no rate yet, not 0
    assert o.newest_ts == T0 + 0.2
    d.add(s("b", 1, T0 + 0.1, arr=5), T0 + 0.3)  # an older timestamp, received later (another clock)
    assert d.observe(T0 + 0.3).newest_ts == T0 + 0.2


def test_staleness_and_forgetting_boundaries() -> None:
    # Stale is silent for *more* than staleAfterSeconds; a gateway right at the limit still counts.
    d = ModelDemand("m", stale_after_s=1.0)
    d.add(s("a", 1, T0, q=4), T0)
    assert d.observe(T0 + 1.0).demand == 4
    o = d.observe(T0 + 2.0)
    assert o.demand is None and o.fresh_gateways == 0 and o.stale_gateways == 1
    assert d.forget_stale(T0 + 10.0, older_than_s=10.0) == 0  # only *longer* than the limit is gone
    assert d.forget_stale(T0 + 11.0, older_than_s=10.0) == 1


def test_rates_are_taken_over_a_gateway_period_not_one_on_change_gap() -> None:
    """A gateway publishes on change, up to every 10 ms: one arrival in 10 ms is not 100 req/s. The rate is over
    the newest reference at least `RATE_SPAN_S` old: 10 req/s, steady, read at every sample."""
    d = ModelDemand("m", stale_after_s=1.0)
    seen = []
    for i in range(40):  # an arrival every 100 ms, each published 10 ms after the 100 ms tick's sample
        tick = T0 + 0.1 * i
        d.add(s("a", 2 * i + 1, tick, q=0, arr=i, comp=i), tick)
        d.add(s("a", 2 * i + 2, tick + 0.01, q=0, arr=i + 1, comp=i), tick + 0.01)
        seen.append(d.observe(tick + 0.01).arrival_rate)
    assert all(r == pytest.approx(10.0, rel=0.1) for r in seen[2:]), seen[:6]
