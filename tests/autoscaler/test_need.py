"""The policy counts what is coming (issue 23): table tests on a hand clock, the activation time a parameter.

A small gateway model feeds `policy.decide` every 100 ms as the real decider does: Poisson arrivals at a given
rate, a FIFO queue, ready replicas serving `CONCURRENCY` requests for `SERVICE_S` each, and replicas asked for
becoming ready one activation later. The gateway's counters give the rates, as `autoscaler.decide.ingest` computes them.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

from autoscaler.decide import need, policy, scalein
from simulate.policies import our_spec

CONCURRENCY = 8
SERVICE_S = 2.0
STEP = 0.1


def run(
    rate: Callable[[float], float],
    *,
    seconds: float,
    activation_s: float,
    replicas: int,
    min_replicas: int = 1,
    max_replicas: int = 1000,
    seed: int = 3,
    stabilization_s: float | None = None,
) -> list[tuple[float, int, int, str]]:
    """(t, desired, ready, mode) after every decision."""
    rng = np.random.default_rng(seed)
    spec = our_spec(target=float(CONCURRENCY), min_replicas=min_replicas, max_replicas=max_replicas,
                    stabilization_s=stabilization_s)  # fmt: skip
    terms = policy.PolicySpec.of(spec)
    state = policy.initial_state(terms, now=0.0, current_replicas=replicas)
    ready, desired = replicas, replicas
    coming: deque[float] = deque()  # ready times of replicas asked for
    queue = 0
    busy: deque[tuple[float, int]] = deque()  # (done at, n)
    in_flight = arrivals = completions = 0
    last = (0, 0)
    out = []
    svc = round(SERVICE_S / STEP)
    # Start in the steady state of the first rate: what arrived over the last service time is in flight.
    for i in range(svc):
        n = round(rate(0.0) * STEP)
        busy.append(((i + 1) * STEP, n))
        in_flight += n
    for k in range(round(seconds / STEP)):
        now = round(k * STEP, 9)
        while coming and coming[0] <= now + 1e-9:
            coming.popleft()
            ready += 1
        while busy and busy[0][0] <= now + 1e-9:
            in_flight -= busy[0][1]
            completions += busy.popleft()[1]
        n = int(rng.poisson(rate(now) * STEP))
        arrivals += n
        queue += n
        take = min(queue, max(ready * CONCURRENCY - in_flight, 0))
        if take:
            queue -= take
            in_flight += take
            busy.append((now + SERVICE_S, take))
        lam = mu = None
        if k:
            lam, mu = (arrivals - last[0]) / STEP, (completions - last[1]) / STEP
        last = (arrivals, completions)
        obs = policy.Observation(
            demand=float(queue + in_flight),
            ready=ready,
            lead_time_s=activation_s,
            queued=float(queue),
            arrival_rate=lam,
            completion_rate=mu,
        )
        d, state = policy.decide(terms, obs, state, now)
        if d.desired > desired:
            coming.extend([now + activation_s] * (d.desired - desired - len(coming) + (desired - ready)))
        elif d.desired < desired:
            drop = desired - d.desired
            while drop and coming:
                coming.pop()
                drop -= 1
            ready -= drop
        desired = d.desired
        out.append((now, desired, ready, d.mode))
    return out


def needed(rps: float) -> int:
    return math.ceil(rps * SERVICE_S / CONCURRENCY)


@pytest.mark.parametrize("activation_s", [0.1, 2.55, 30.0])
def test_a_pulse_gets_what_it_needs_not_its_backlog(activation_s: float) -> None:
    """A step from 140 to 600 req/s (50 -> 150 replicas at 8 x 2 s): the count reaches the need and never asks
    for the backlog that builds while the capacity activates (before: 175-300 at 2.55 s)."""
    rows = run(lambda t: 600.0 if t >= 60 else 140.0, seconds=60 + 3 * activation_s + 60, activation_s=activation_s,
               replicas=50, min_replicas=50)  # fmt: skip
    pulse = [r for r in rows if r[0] >= 60]
    peak = max(d for _, d, _, _ in pulse)
    assert peak <= 1.10 * needed(600), peak
    assert max(d for _, d, _, _ in pulse[-100:]) >= needed(600) - 1  # reached the need (a replica of noise)
    assert any(m == "panic" for *_, m in pulse)
    # Panic never scales down in the burst.
    ds = [d for _, d, _, m in pulse if m == "panic"]
    assert all(b >= a for a, b in itertools.pairwise(ds))


@pytest.mark.parametrize("activation_s", [0.1, 2.55, 30.0])
def test_a_flat_load_holds_a_flat_count(activation_s: float) -> None:
    """18 req/s is 4.5 replicas' work (5): once the start's recommendations left the stabilisation window, one
    count, no flapping, and never above the need + 1. (At exactly 100 % a queue grows without bound, and a sixth
    replica is right.)"""
    rows = run(lambda t: 18.0, seconds=300, activation_s=activation_s, replicas=5)
    after = {d for t, d, _, _ in rows if t >= 130}
    assert len(after) == 1, sorted(after)
    assert after.pop() <= needed(18) + 1


@pytest.mark.parametrize("activation_s", [0.1, 2.55, 30.0])
def test_a_trickle_from_idle_asks_for_what_it_needs_only(activation_s: float) -> None:
    """1 req/s from one idle replica (the need is 1): one sample's slope is no evidence, nothing more is asked."""
    rows = run(lambda t: 1.0 if t >= 30 else 0.0, seconds=150, activation_s=activation_s, replicas=1)
    assert max(d for _, d, _, _ in rows) == 1


@pytest.mark.parametrize("stabilization_s", [None, 60.0])
@pytest.mark.parametrize("activation_s", [0.1, 2.55, 30.0])
def test_scale_in_keeps_its_stabilisation(activation_s: float, stabilization_s: float | None) -> None:
    """600 -> 140 req/s: no step down within the stabilisation window after the load fell (unset: the hold, one
    lead time between the panic window and 60 s), at most one step per window after it, and none up."""
    rows = run(lambda t: 140.0 if t >= 90 else 600.0, seconds=300, activation_s=activation_s, replicas=150,
               min_replicas=1, stabilization_s=stabilization_s)  # fmt: skip
    spec = our_spec(target=float(CONCURRENCY), min_replicas=1, max_replicas=1000, stabilization_s=stabilization_s)
    hold_s = scalein.scale_in(spec, activation_s).hold_s
    assert hold_s == (stabilization_s or min(max(activation_s, 6.0), 60.0))
    after = [(t, d) for t, d, _, _ in rows if t >= 90]
    # Within the window the count stays at the pulse's (the window's highest recommendation; a replica or two of
    # noise held in panic may go).
    assert min(d for t, d in after if t < 90 + hold_s) >= 0.9 * needed(600)
    pairs = list(itertools.pairwise(after))
    assert not [t for (_, prev), (t, d) in pairs if d > prev]
    steps = [t for (_, prev), (t, d) in pairs if d < prev and t >= 90 + hold_s]
    assert steps and all(b - a >= hold_s - 1e-6 for a, b in itertools.pairwise(steps)), steps
    if stabilization_s is None:  # the hold, and 100 % per hold: it got there (60 s and 50 %/60 s: still on its way)
        assert after[-1][1] <= 1.15 * needed(140), after[-1]  # within the rate's upper bound (140 + 2 sigma: 37)


def test_the_rate_is_a_lower_bound_that_tightens_with_evidence() -> None:
    """The arrival rate read over 0.1 s is taken well below its value; over the full window, close to it."""
    cfg = need.NeedConfig(rate_window_s=6.0, service_window_s=60.0, target=8.0, carry_s=1.0)
    st = need.initial(cfg)
    for k in range(61):  # 6 s of a steady 600 req/s flow, 1200 in flight: the service time is learnt (2 s)
        st = need.record(cfg, st, now=k * 0.1, arrival_rate=600.0, completion_rate=600.0, in_flight=1200.0)
    assert st.service_s == pytest.approx(2.0)
    full = need.estimate(cfg, st, now=6.0, queued=0.0, lead_s=0.1)
    # A surge (the panic condition) began with the next sample: its rate is read from there, 0.2 s of evidence.
    surge = need.record(cfg, st, now=6.1, arrival_rate=600.0, completion_rate=600.0, in_flight=1200.0, surge=True)
    early = need.estimate(cfg, surge, now=6.1, queued=0.0, lead_s=0.1)
    assert full is not None and early is not None
    assert 0.95 * 150 < full.replicas < 150
    assert early.replicas < 0.9 * full.replicas
    assert full.backlog == 0 and full.drain_replicas == 0


def test_a_backlog_is_drained_within_the_headroom() -> None:
    """A projected backlog adds capacity to drain it, at most `HEADROOM` of the need (and at least one replica)."""
    cfg = need.NeedConfig(rate_window_s=6.0, service_window_s=60.0, target=8.0, carry_s=1.0)
    st = need.initial(cfg)
    for k in range(61):
        st = need.record(cfg, st, now=k * 0.1, arrival_rate=600.0, completion_rate=600.0, in_flight=1200.0)
    calm = need.estimate(cfg, st, now=6.0, queued=40.0, lead_s=0.1)
    assert calm is not None and calm.drain_replicas == 0  # throughput outpaces it: a queue's noise
    for k in range(61, 71):  # a second of completions at 400 req/s: the backlog grows
        st = need.record(cfg, st, now=k * 0.1, arrival_rate=600.0, completion_rate=400.0, in_flight=1200.0)
    small = need.estimate(cfg, st, now=7.0, queued=40.0, lead_s=0.1)
    big = need.estimate(cfg, st, now=7.0, queued=12_000.0, lead_s=30.0)
    assert small is not None and big is not None
    projected = 40 + (small.arrival_rate - 400.0) * 0.1
    assert small.backlog == pytest.approx(projected)
    assert small.drain_replicas == pytest.approx(projected / need.DRAIN_SERVICES / 8.0, rel=1e-6)
    steady = big.replicas - big.drain_replicas
    assert big.drain_replicas == pytest.approx(need.HEADROOM * steady)


def test_without_a_service_time_the_queue_depth_decides() -> None:
    """No balanced flow seen yet (from idle, nothing completed): no estimate; the policy reads the demand."""
    cfg = need.NeedConfig(rate_window_s=6.0, service_window_s=60.0, target=8.0, carry_s=1.0)
    st = need.initial(cfg)
    for k in range(30):
        st = need.record(cfg, st, now=k * 0.1, arrival_rate=160.0, completion_rate=0.0, in_flight=16.0 * k)
    assert st.service_s is None
    assert need.estimate(cfg, st, now=3.0, queued=0.0, lead_s=0.1) is None


# --- autoscaler.decide.need on a hand clock, reading by reading -------------------------------------------------------

CFG = need.NeedConfig(rate_window_s=6.0, service_window_s=60.0, target=8.0, carry_s=1.0)


def feed(
    st: need.NeedState,
    start: float,
    seconds: float,
    *,
    lam: float,
    mu: float,
    busy: float,
    ready: int = 0,
    queued: float = 0.0,
    surge: bool = False,
    cfg: need.NeedConfig = CFG,
) -> need.NeedState:
    """Readings every 100 ms from `start` for `seconds` (inclusive of both ends)."""
    for k in range(round(seconds / 0.1) + 1):
        st = need.record(cfg, st, now=round(start + 0.1 * k, 6), arrival_rate=lam, completion_rate=mu,
                         in_flight=busy, ready=ready, queued=queued, surge=surge)  # fmt: skip
    return st


def test_the_config_reads_the_scaled_objects_windows() -> None:
    spec = our_spec(target=4.0, min_replicas=1, max_replicas=10)
    cfg = need.config(spec, 4.0)
    adv = spec.advanced
    assert cfg == need.NeedConfig(adv.panic_window_seconds, adv.stable_window_seconds, 4.0, adv.stale_after_seconds)


def test_the_service_time_is_learnt_once_a_full_window_balances() -> None:
    st = feed(need.initial(CFG), 0.0, 5.9, lam=600, mu=600, busy=1200)
    assert st.service_s is None  # 5.9 s of a 6 s window: not yet
    st = feed(st, 6.0, 0.0, lam=600, mu=600, busy=1200)
    assert st.service_s == pytest.approx(2.0) and st.recorded_at == 6.0
    # Out of balance (arrivals 30 % over completions, not saturated): nothing learnt.
    off = feed(need.initial(CFG), 0.0, 6.0, lam=780, mu=600, busy=1200)
    assert off.service_s is None
    # No completions, or nothing in flight: nothing to divide.
    assert feed(need.initial(CFG), 0.0, 6.0, lam=0, mu=0, busy=0).service_s is None


def test_the_service_time_moves_by_the_time_since_the_last_reading_over_the_stable_window() -> None:
    st = feed(need.initial(CFG), 0.0, 6.0, lam=600, mu=600, busy=1200)
    nxt = need.record(CFG, st, now=6.1, arrival_rate=600, completion_rate=600, in_flight=1800)
    seen = (1200 * 59 + 1800) / 60 / 600  # the window's (6 s: 60 readings) mean in flight over its completions
    assert nxt.service_s == pytest.approx(2.0 + (seen - 2.0) * 0.1 / 60, rel=1e-9)
    # After a long silence the new reading is the whole of it (the weight stops at 1).
    late = need.record(CFG, st, now=1006.0, arrival_rate=600, completion_rate=600, in_flight=1800)
    assert late.service_s == pytest.approx(3.0)


def test_saturation_is_tracked_at_one_ready_count_and_teaches_the_service_time() -> None:
    st = feed(need.initial(CFG), 0.0, 1.0, lam=600, mu=400, busy=800, ready=100, queued=1)
    assert st.saturated_since == 0.0  # one request queued counts
    st = feed(st, 1.1, 4.8, lam=600, mu=400, busy=800, ready=100, queued=50)
    assert st.saturated_since == 0.0 and st.service_s is None  # 5.9 s saturated: not yet a window
    st = feed(st, 6.0, 0.0, lam=600, mu=400, busy=800, ready=100, queued=50)
    assert st.service_s == pytest.approx(2.0)  # 800 busy / 400 completed: Little's law while saturated
    moved = feed(st, 6.1, 0.0, lam=600, mu=400, busy=800, ready=101, queued=50)
    assert moved.saturated_since == 6.1  # a new ready count starts it again
    calm = feed(moved, 6.2, 0.0, lam=600, mu=400, busy=800, ready=101, queued=0)
    assert calm.saturated_since is None


def test_once_known_the_service_time_waits_a_window_and_a_service_time_of_saturation() -> None:
    st = feed(need.initial(CFG), 0.0, 6.0, lam=400, mu=400, busy=800)  # 2 s learnt, balanced
    st = feed(st, 6.1, 7.8, lam=600, mu=400, busy=800, ready=100, queued=50)  # saturated from 6.1 to 13.9
    assert st.service_s == pytest.approx(2.0)
    # 7.9 s saturated < the window (6 s) + the service time (2 s): the completions may still be the old rate's.
    early = need.record(CFG, st, now=14.0, arrival_rate=600, completion_rate=400, in_flight=1600, ready=100, queued=50)
    assert early.service_s == pytest.approx(2.0)
    late = need.record(CFG, early, now=14.2, arrival_rate=600, completion_rate=400, in_flight=1600, ready=100,
                       queued=50)  # fmt: skip
    assert late.service_s is not None and late.service_s > 2.0 + 1e-6


def test_a_surge_is_dated_from_its_first_reading() -> None:
    st = feed(need.initial(CFG), 0.0, 1.0, lam=10, mu=10, busy=20)
    assert st.surge_since is None
    st = feed(st, 1.1, 0.5, lam=60, mu=10, busy=20, surge=True)
    assert st.surge_since == 1.1
    assert feed(st, 1.7, 0.0, lam=60, mu=10, busy=20).surge_since is None


def test_new_windows_on_a_spec_change() -> None:
    st = feed(need.initial(CFG), 0.0, 6.0, lam=600, mu=600, busy=1200)
    assert st.service_s is not None
    for changed in (
        need.NeedConfig(6.0, 30.0, 8.0, 1.0),  # another stable window
        need.NeedConfig(6.0, 60.0, 8.0, 2.0),  # another staleness (the windows' carry)
    ):
        fresh = need.record(changed, st, now=6.1, arrival_rate=600, completion_rate=600, in_flight=1200)
        assert fresh.service_s is None and fresh.arrivals.first_ts == 6.1


def learnt(lam: float = 600.0, *, seconds: float = 6.0, cfg: need.NeedConfig = CFG) -> need.NeedState:
    """`lam` req/s for `seconds`, balanced, 2 s each (learnt once a window is full)."""
    return feed(need.initial(cfg), 0.0, seconds, lam=lam, mu=lam, busy=lam * 2, cfg=cfg)


def low(lam: float, span: float) -> float:
    return lam - need.RATE_Z * math.sqrt(lam / span)


def test_the_estimate_reads_the_rate_over_the_panic_window_or_the_data_there_is() -> None:
    st = learnt()
    got = need.estimate(CFG, st, now=6.0, queued=0.0, lead_s=0.1)
    assert got is not None and got.arrival_rate == pytest.approx(low(600, 6.0))
    assert got.service_s == pytest.approx(2.0)
    assert got.replicas == pytest.approx(low(600, 6.0) * 2.0 / 8.0)
    assert got.high == pytest.approx((600 + (600 - low(600, 6.0))) * 2.0 / 8.0)
    # A short stable window (the demo's 6 s): the service time is learnt on the panic window all the same.
    short = need.NeedConfig(1.0, 6.0, 1.0, 1.0)
    st2 = learnt(60.0, seconds=2.0, cfg=short)
    got2 = need.estimate(short, st2, now=2.0, queued=0.0, lead_s=0.5)
    assert got2 is not None and got2.arrival_rate == pytest.approx(low(60, 1.0))


def test_a_surge_reads_the_rate_from_its_start() -> None:
    st = learnt(100.0, seconds=30.0)
    st = feed(st, 30.1, 2.9, lam=600, mu=100, busy=200, surge=True)  # 30.1 .. 33.0: 30 readings
    got = need.estimate(CFG, st, now=33.0, queued=0.0, lead_s=0.1)
    assert got is not None and got.arrival_rate == pytest.approx(low(600, 3.0), rel=1e-6)


def test_a_young_window_reads_over_what_it_has() -> None:
    st = feed(need.initial(CFG), 0.0, 6.0, lam=600, mu=600, busy=1200)
    later = feed(st, 6.1, 0.0, lam=600, mu=600, busy=1200)
    assert need.estimate(CFG, later, now=6.1, queued=0.0, lead_s=0.1) is not None
    # Learnt on 6 s, the rate over the whole of the data: the same as the window's.
    got = need.estimate(CFG, st, now=6.0, queued=0.0, lead_s=0.1)
    assert got is not None and got.arrival_rate == pytest.approx(low(600, 6.0))


def test_what_exists_bounds_the_need_of_a_burst() -> None:
    """A 1 s burst of 2 s requests: 600 exist, and 60 more arrive in the lead time; not 1,200."""
    st = learnt()
    got = need.estimate(CFG, st, now=6.0, queued=0.0, lead_s=0.1, demand=600.0)
    assert got is not None
    assert got.replicas == pytest.approx((600 + low(600, 6.0) * 0.1) / 8.0)
    assert got.high == pytest.approx((600 + (2 * 600 - low(600, 6.0)) * 0.1) / 8.0)
    roomy = need.estimate(CFG, st, now=6.0, queued=0.0, lead_s=0.1, demand=5000.0)
    assert roomy is not None and roomy.replicas == pytest.approx(low(600, 6.0) * 2.0 / 8.0)


def test_a_saturated_count_bounds_the_need_from_below() -> None:
    """100 replicas busy for 10 s complete 300 req/s, 3 each: 600 arriving need 200 of them, whatever the 1.5 s
    service time learnt at a lighter load says (150)."""
    st = feed(need.initial(CFG), 0.0, 6.0, lam=600, mu=600, busy=900)  # 1.5 s learnt
    st = feed(st, 6.1, 9.9, lam=600, mu=300, busy=800, ready=100, queued=50)
    assert st.service_s is not None
    w = st.service_s
    got = need.estimate(CFG, st, now=16.0, queued=0.0, lead_s=0.1)
    assert got is not None
    assert got.replicas - got.drain_replicas == pytest.approx(max(low(600, 6.0) / 3.0, low(600, 6.0) * w / 8.0))
    assert got.high == pytest.approx(max((2 * 600 - low(600, 6.0)) / 3.0, (2 * 600 - low(600, 6.0)) * w / 8.0))


def test_a_short_service_time_is_a_service_time() -> None:
    """The demo's engines answer in ~50 ms: a need of 3 replicas, not none."""
    short = need.NeedConfig(1.0, 6.0, 1.0, 1.0)
    st = feed(need.initial(short), 0.0, 6.0, lam=60, mu=60, busy=3, cfg=short)
    got = need.estimate(short, st, now=6.0, queued=0.0, lead_s=0.5)
    assert got is not None and got.service_s == pytest.approx(0.05)
    assert got.replicas == pytest.approx(low(60, 1.0) * 0.05)


def test_a_queue_with_nothing_ready_reads_no_throughput() -> None:
    """Every replica gone while requests still complete and queue: no per-replica throughput to divide by."""
    st = learnt()
    st = feed(st, 6.1, 10.0, lam=600, mu=300, busy=600, ready=0, queued=100)
    got = need.estimate(CFG, st, now=16.1, queued=100.0, lead_s=0.1)
    assert got is not None and got.replicas - got.drain_replicas == pytest.approx(low(600, 6.0) * 2.0 / 8.0)


def test_a_small_models_drain_is_at_most_one_replica() -> None:
    """5 % of a 2-replica need is a tenth of one: a growing backlog may still add one replica, never two."""
    st = feed(need.initial(CFG), 0.0, 6.0, lam=8, mu=8, busy=16)
    st = feed(st, 6.1, 1.0, lam=8, mu=2, busy=16)  # completions fell to 2 req/s: the backlog grows
    got = need.estimate(CFG, st, now=7.1, queued=500.0, lead_s=2.5)
    assert got is not None and got.drain_replicas == pytest.approx(1.0)
