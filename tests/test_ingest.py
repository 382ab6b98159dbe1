"""Folding gateway samples into demand, on a hand-advanced clock."""

from __future__ import annotations

import pytest

from autoscaler.ingest import ModelDemand
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
