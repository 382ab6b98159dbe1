"""The simulation's baselines pinned to their documented behaviour, on a hand-advanced clock (tables, as Knative's
autoscaler tests): HPA v2 tolerance, rate policies and the 300 s scale-down window; KEDA's activation poll and
cooldown; Knative KPA's panic entry, hold and exit. `simulate.policies` cites the documentation."""

from __future__ import annotations

import pytest

from simulate.policies import HPA, KEDA, KPA

T = 8.0  # target demand per replica


@pytest.mark.parametrize(
    ("current", "demand", "want"),
    [
        (10, 10 * T * 1.09, 10),  # 9 % over target: within the 0.1 tolerance, no change
        (10, 10 * T * 0.91, 10),  # 9 % under: no change either
        (10, 10 * T * 1.11, 12),  # 11 % over: ceil(88.8 / 8) = 12
        (10, 10 * T * 0.5, 5),  # ratio 0.5: ceil(40 / 8) = 5 (before behavior)
    ],
)
def test_hpa_tolerance(current: int, demand: float, want: int) -> None:
    assert HPA(target=T).raw(demand, current) == want


@pytest.mark.parametrize(
    ("current", "want"),
    [
        (2, 6),  # Pods 4 beats Percent 100 (2 -> 4): 2 + 4
        (4, 8),  # both give 8
        (10, 20),  # Percent 100 beats Pods 4: 10 -> 20
    ],
)
def test_hpa_scale_up_rate_is_the_larger_of_100_percent_and_4_pods_per_15_s(current: int, want: int) -> None:
    hpa = HPA(target=T, min_replicas=1, max_replicas=1000)
    assert hpa.desired(0.0, 10_000.0, current) == want


def test_hpa_scale_up_rate_counts_from_the_period_start() -> None:
    hpa = HPA(target=T, min_replicas=1, max_replicas=1000)
    assert hpa.desired(0.0, 10_000.0, 10) == 20
    # 14 s later the same 15 s period: the start was 10, so 20 is still the limit.
    assert hpa.desired(14.0, 10_000.0, 20) == 20
    # At 15 s the period has passed: 20 -> 40.
    assert hpa.desired(15.0, 10_000.0, 20) == 40


def test_hpa_scale_down_waits_for_the_300_s_window() -> None:
    hpa = HPA(target=T, min_replicas=1, max_replicas=100)
    table = [
        # (now, demand, current, want)
        (0.0, 20 * T, 20, 20),
        (15.0, 2 * T, 20, 20),  # the 20 recommended at 0 s is in the window
        (150.0, 2 * T, 20, 20),
        (285.0, 2 * T, 20, 20),
        (300.0, 2 * T, 20, 2),  # the 0 s recommendation left the window; Percent 100 / 15 s allows all of it
    ]
    for now, demand, current, want in table:
        assert hpa.desired(now, demand, current) == want, now


def test_hpa_bounds_and_zero() -> None:
    hpa = HPA(target=T, min_replicas=3, max_replicas=5)
    assert hpa.desired(0.0, 1000.0, 4) == 5
    assert hpa.desired(0.0, 0.0, 0) == 0  # a target at 0 replicas is not scaled by the HPA
    assert HPA(target=T, min_replicas=3, max_replicas=5, behavior=hpa.behavior).desired(0.0, 0.0, 4) == 3


def test_keda_activates_from_zero_only_on_its_30_s_poll() -> None:
    keda = KEDA(HPA(target=T, min_replicas=1, max_replicas=100), min_replicas=0)
    assert keda.desired(0.0, 0.0, 0) is None  # poll at 0 s: nothing to do
    assert keda.desired(15.0, 0.0, 0) is None
    assert keda.desired(30.0, 0.0, 0) is None  # poll at 30 s: still nothing
    # Demand appears at 31 s and is seen on the 45 s sample: nothing until the next poll at 60 s.
    assert keda.desired(45.0, 50.0, 0) is None
    assert keda.desired(60.0, 50.0, 0) == 1
    # From 1 replica the HPA takes over at its next sync (75 s): ceil(50 / 8) = 7, within 1 + 4 pods.
    assert keda.desired(75.0, 50.0, 1) == 5  # rate: max(1 + 4 pods, 2 x 1) = 5
    assert keda.desired(90.0, 50.0, 5) == 7


def test_keda_deactivates_after_the_cooldown() -> None:
    keda = KEDA(HPA(target=T, min_replicas=1, max_replicas=100), min_replicas=0)
    assert keda.desired(0.0, 10.0, 2) == 2  # active at 0 s
    for now in (30.0, 60.0, 90.0, 120.0, 150.0, 180.0, 210.0, 240.0, 270.0):
        assert keda.desired(now, 0.0, 1) in (None, 1), now
    assert keda.desired(300.0, 0.0, 1) == 0  # 300 s without activity: KEDA itself scales to 0


def _kpa_feed(kpa: KPA, t0: float, t1: float, demand: float, ready: int) -> list[tuple[float, int | None]]:
    out = []
    t = t0
    while t < t1 - 1e-9:
        kpa.record(t, demand)
        if t + 1e-9 >= kpa.next_tick:
            kpa.next_tick += kpa.tick_s
            out.append((t, kpa.scale(t, ready)))
        t += 1.0
    return out


def test_kpa_enters_panic_at_200_percent_of_ready_capacity_over_6_s() -> None:
    kpa = KPA(target=T, min_replicas=1)
    steady = _kpa_feed(kpa, 0.0, 60.0, 10 * T, 10)
    assert all(want == 10 for _, want in steady) and not kpa.in_panic
    # Demand jumps to 3x: the 6 s mean reaches 2x (160) once 3 of its 6 samples are at 240 (mean 160).
    ticks = _kpa_feed(kpa, 60.0, 66.0, 30 * T, 10)
    assert kpa.in_panic and kpa.panics == 1
    assert ticks[-1][1] is not None and ticks[-1][1] >= 20


@pytest.mark.parametrize(("at", "panic"), [(60.0, False), (62.0, True)])
def test_kpa_panic_condition_table(at: float, panic: bool) -> None:
    kpa = KPA(target=T, min_replicas=1)
    _kpa_feed(kpa, 0.0, 60.0, 10 * T, 10)
    _kpa_feed(kpa, 60.0, at + 1.0, 30 * T, 10)
    assert kpa.in_panic is panic


def test_kpa_never_scales_down_in_panic_and_leaves_a_stable_window_after() -> None:
    kpa = KPA(target=T, min_replicas=1)
    _kpa_feed(kpa, 0.0, 60.0, 10 * T, 10)
    _kpa_feed(kpa, 60.0, 70.0, 30 * T, 10)
    assert kpa.in_panic
    peak = kpa.max_panic_pods
    last_over = kpa.panic_at
    assert last_over is not None
    # Demand back to normal: the panic count holds (never down) until a stable window after the condition.
    calm = _kpa_feed(kpa, 70.0, last_over + 60.0 + 0.5, 10 * T, 30)
    assert all(want == peak for _, want in calm)
    assert kpa.in_panic
    after = _kpa_feed(kpa, last_over + 61.0, last_over + 64.0, 10 * T, 30)
    assert not kpa.in_panic
    assert after[-1][1] is not None and after[-1][1] < peak


def test_kpa_scale_up_is_bounded_by_1000_times_ready() -> None:
    kpa = KPA(target=1.0, min_replicas=0)
    kpa.record(0.0, 5000.0)
    assert kpa.scale(0.0, 1) == 1000
    assert kpa.scale(2.0, 0) == 1000  # ready counts as at least 1
